"""The marker class stored in rfa_* checkpoints; its loading and saving live in `checkpoints`.

It stays in this module because its qualified name, rfa_fairseq.checkpoint_safety.NeedsUserDirRfaFairseq,
is written into every rfa_* checkpoint: moving it would change that on-disk name (checkpoints already
written would name a class that no longer exists there) and the text users see (below).
"""


class NeedsUserDirRfaFairseq:
    """Marker stored in rfa_* checkpoints. Its qualified name is the message a user sees when a
    checkpoint is loaded without the plugin: torch's "Unsupported global: GLOBAL
    rfa_fairseq.checkpoint_safety.NeedsUserDirRfaFairseq", the only text we can put in front of a
    user whose process never imported this plugin. Pass `--user-dir path/to/rfa_fairseq`."""

    hint = "load this checkpoint with --user-dir path/to/rfa_fairseq (the rfa_fairseq plugin)"

    def __eq__(self, other):
        return isinstance(other, NeedsUserDirRfaFairseq)

    def __hash__(self):
        return hash(NeedsUserDirRfaFairseq)

    def __repr__(self):
        return "NeedsUserDirRfaFairseq()"
