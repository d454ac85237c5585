#!/usr/bin/env python3
"""Where a real-data batch's time goes on a GPU: fairseq-generate's generator (the static beam search, its step one
CUDA graph) on Multi30k test batches, batch by batch, with and without graphs.

For each batch size: fairseq-generate's own set-up (the options fairseq-generate gets from benchmark_generate.py:
beam 4, --max-len-a 1 --max-len-b 50, --fp16), then the whole test set twice through one generator (the first pass
pays every capture, the second shows what is left once graphs exist), each batch timed to the device's end, with the
captures and replays it made (uncaptured: one pass); then torch's profiler over one batch of the last pass (host and device time per
operation). Writes profile_batches_<gpu>.csv (one row per batch and pass) and profile_batches_<gpu>_b<N>_<mode>.txt
(the profiler's tables).

    python benchmarks/gpu/profile_batches.py --prep .gpu/multi30k --checkpoint CKPT --batch-sizes 32 128 --out-dir OUT
"""
import argparse
import csv
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, os.path.join(REPO, "tests"))  # graph_counting: the test aid that counts a generator's graphs


DEVICE_SORT = "self_device_time_total"  # the profiler table sorted by device time


def setup(args, batch_size, graphs):
    import torch
    from fairseq import checkpoint_utils, options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    import rfa_fairseq  # noqa: F401  (registers the plugin)

    overrides = {"rfa_cuda_graphs": graphs}
    if args.no_triton_self_check:  # this GPU's kernels were checked before (run_all.sh's self_check stage)
        overrides["rfa_triton_self_check"] = False
    argv = [os.path.join(args.prep, "data-bin"), "--user-dir", os.path.join(REPO, "rfa_fairseq"), "--path", args.checkpoint,
            "--gen-subset", "test", "--beam", "4", "--lenpen", "1", "--max-len-a", "1", "--max-len-b", "50",
            "--batch-size", str(batch_size), "--required-batch-size-multiple", "1", "--fp16", "--num-workers", "0",
            "--model-overrides", repr(overrides)]
    cfg = convert_namespace_to_omegaconf(options.parse_args_and_arch(options.get_generation_parser(), argv))
    task = tasks.setup_task(cfg.task)
    task.load_dataset("test")
    models, _ = checkpoint_utils.load_model_ensemble([args.checkpoint], arg_overrides=overrides, task=task)
    model = models[0].half().cuda().eval()
    generator = task.build_generator([model], cfg.generation)
    batches = list(task.get_batch_iterator(dataset=task.dataset("test"), max_sentences=batch_size,
                                           required_batch_size_multiple=1, num_workers=0).next_epoch_itr(shuffle=False))
    torch.cuda.synchronize()
    return task, model, generator, batches


def counting(generator):
    """The generator's graph backend counting its captures and replays, or None (no graphs)."""
    from graph_counting import CountingBackend

    return CountingBackend.of(getattr(generator, "graphs", None))


def run_batch(task, model, generator, sample):
    import torch
    from fairseq import utils

    sample = utils.move_to_cuda(sample)
    torch.cuda.synchronize()
    start = time.perf_counter()
    hypos = task.inference_step(generator, [model], sample)
    torch.cuda.synchronize()
    return time.perf_counter() - start, sum(len(h[0]["tokens"]) for h in hypos)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prep", required=True, help="the Multi30k preparation (data-bin/ inside)")
    p.add_argument("--checkpoint", required=True, help="an rfa_transformer checkpoint")
    p.add_argument("--batch-sizes", nargs="+", type=int, default=[32, 128])
    p.add_argument("--out-dir", required=True)
    p.add_argument("--profile-rows", type=int, default=30)
    p.add_argument("--no-triton-self-check", action="store_true",
                   help="--no-rfa-triton-self-check: the first batch's time without the Triton kernels' self-check "
                        "(for a GPU checked before: benchmarks/gpu/self_check.py)")
    args = p.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from benchmark_common import device_tag

    os.makedirs(args.out_dir, exist_ok=True)
    tag = device_tag("cuda")
    csv_path = os.path.join(args.out_dir, f"profile_batches_{tag}.csv")
    fields = ["batch_size", "graphs", "pass", "batch", "sentences", "src_len", "tokens", "seconds", "captures", "replays"]
    with open(csv_path, "w", newline="") as f:
        csv.DictWriter(f, fields).writeheader()
    for batch_size in args.batch_sizes:
        for graphs in (True, False):
            task, model, generator, batches = setup(args, batch_size, graphs)
            for pass_ in ((1, 2) if graphs else (1,)):  # uncaptured steps capture nothing: one pass
                totals = [0.0, 0, 0]
                for i, sample in enumerate(batches):
                    backend = counting(generator)
                    before = (backend.captures, backend.replays) if backend else (0, 0)
                    seconds, tokens = run_batch(task, model, generator, sample)
                    after = (backend.captures, backend.replays) if backend else (0, 0)
                    row = {"batch_size": batch_size, "graphs": int(graphs), "pass": pass_, "batch": i,
                           "sentences": sample["nsentences"], "src_len": sample["net_input"]["src_tokens"].size(1),
                           "tokens": tokens, "seconds": f"{seconds:.4f}", "captures": after[0] - before[0],
                           "replays": after[1] - before[1]}
                    with open(csv_path, "a", newline="") as f:
                        csv.DictWriter(f, fields).writerow(row)
                    totals = [totals[0] + seconds, totals[1] + row["captures"], totals[2] + row["replays"]]
                print(f"batch {batch_size} graphs {graphs} pass {pass_}: {len(batches)} batches {totals[0]:.2f} s "
                      f"({sum(s['nsentences'] for s in batches) / totals[0]:.1f} sentences/s), "
                      f"captures {totals[1]}, replays {totals[2]}", flush=True)
            sample = batches[len(batches) // 2]
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                seconds, _ = run_batch(task, model, generator, sample)
            mode = "graphs" if graphs else "eager"
            table_path = os.path.join(args.out_dir, f"profile_batches_{tag}_b{batch_size}_{mode}.txt")
            with open(table_path, "w") as f:
                f.write(f"batch {len(batches) // 2} of {len(batches)}: {sample['nsentences']} sentences, {seconds:.4f} s\n\n")
                averages = prof.key_averages()
                f.write(averages.table(sort_by="self_cpu_time_total", row_limit=args.profile_rows))
                f.write("\n\n")
                f.write(averages.table(sort_by=DEVICE_SORT, row_limit=args.profile_rows))
            print(f"profile: {table_path}", flush=True)
            del generator, model
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
