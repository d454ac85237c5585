"""Text input, one rule for every tool that reads sentences (rfa-score, rfa-check-data,
fairseq-interactive with the plugin): input is UTF-8, and a line that is not is an error naming the
file, the line and the first bad byte. Never a silent replacement: a sentence turned into <unk> or
U+FFFD would be translated or scored as something the user did not write.

Standard library only: scripts/generate.sh runs rfa_fairseq/cli/scoring.py as a file (without
importing the package, which imports fairseq), and it loads this file on its own."""
import sys

STDIN = "-"


class InputEncodingError(ValueError):
    """A line of a text input is not valid UTF-8."""


def describe_utf8_error(raw: bytes, exc: UnicodeDecodeError) -> str:
    return f"not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"


def decode_line(raw: bytes, path, number: int) -> str:
    """`raw` (one line, its end removed) as text; InputEncodingError naming path:number otherwise."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        name = "<stdin>" if path == STDIN else path
        raise InputEncodingError(
            f"{name}:{number}: {describe_utf8_error(raw, exc)}: input must be UTF-8; convert the file "
            f"(e.g. iconv -f latin1 -t utf-8) or list every such line with rfa-check-data raw") from None


def read_utf8_lines(path):
    """(line number, text) of each line of `path` ("-": standard input); only "\\n" ends a line."""
    handle = sys.stdin.buffer if path == STDIN else open(path, "rb")
    try:
        for number, raw in enumerate(handle, start=1):
            yield number, decode_line(raw[:-1] if raw.endswith(b"\n") else raw, path, number)
    finally:
        if handle is not sys.stdin.buffer:
            handle.close()


def buffered_read_utf8(input, buffer_size):
    """fairseq-interactive's `buffered_read` (lists of up to buffer_size stripped lines of --input, a
    file or "-") under the rule above; it read files as strict UTF-8 without naming the line and turned
    bad bytes on standard input into <unk>. Lines end where fairseq's text mode ended them
    (\\n, \\r\\n or \\r)."""
    buffer = []
    for _, text in read_utf8_lines(input):
        for line in text.split("\r") if "\r" in text.rstrip("\r") else [text]:
            buffer.append(line.strip())
            if len(buffer) >= buffer_size:
                yield buffer
                buffer = []
    if buffer:
        yield buffer


buffered_read_utf8.rfa_fairseq_wrapper = True
