"""Summarise one GPU run (the files that came back from build/gpu/stage1-3.sh) into
results/gpu_training_<gpu>.json: device, the `gpu` tests' outcome, how long each stage took,
and per drafter the budget it trained under and where its training ended.

    python build/gpu/summarize.py RETURNED_DIR [--out results/gpu_training_nvidia_h200.json]

RETURNED_DIR holds gpu_tests.log and kernels_<gpu>.json (stage 1), stage2.log, and the
unpacked ret.tar (drafters/, results/, logs/)."""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

KEEP = ("name", "kind", "head", "steps", "planned_steps", "time_budget_s", "train_seconds", "device",
        "batch_sequences", "anchors_per_sequence", "block_size", "lr", "trainable_params", "final",
        "final_accept_proxy_k", "data_generated_tokens", "data_sequences")


def summarize(ret: Path) -> dict:
    kernels = next(ret.glob("kernels_*.json"), None)
    k = json.loads(kernels.read_text()) if kernels else {}
    tests = (ret / "gpu_tests.log").read_text() if (ret / "gpu_tests.log").is_file() else ""
    outcome = re.findall(r"(\d+) (passed|failed|skipped|error)", tests.splitlines()[-1] if tests else "")
    stage2 = (ret / "stage2.log").read_text() if (ret / "stage2.log").is_file() else ""
    at = {m[0]: int(m[1]) for m in re.findall(r"^(\S+) (?:done|rc=\d+) at (\d+)s", stage2, re.M)}
    data2 = (ret / "logs" / "data2.log").read_text() if (ret / "logs" / "data2.log").is_file() else ""
    gen = re.findall(r"(\d+)/(\d+) \[(\d+):(\d+)<.*?([\d.]+)seq/s", data2.replace("\r", "\n"))
    trainings = {}
    for f in sorted((ret / "results").glob("train_*.json")):
        d = json.loads(f.read_text())
        trainings[d["name"]] = {key: d[key] for key in KEEP if key in d}
    return {
        "device": k.get("device"), "torch": k.get("torch"), "triton": k.get("triton"),
        "gpu_tests": {"summary": {kind: int(n) for n, kind in outcome},
                      "failed": re.findall(r"^FAILED (\S+)", tests, re.M) or
                      re.findall(r"_{3,} (test_\w+) _{3,}", tests)},
        "stage2_seconds_at": at,
        "second_data_folder": ({"sequences_done": int(gen[-1][0]), "sequences": int(gen[-1][1]),
                                "seconds": 60 * int(gen[-1][2]) + int(gen[-1][3]),
                                "sequences_per_s": float(gen[-1][4]),
                                "finished": "data2 rc=0" in stage2} if gen else None),
        "concurrent_trainings": len(trainings),
        "trainings": trainings,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("returned", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    res = summarize(args.returned)
    slug = re.sub(r"[^a-z0-9]+", "_", (res["device"] or "gpu").lower()).strip("_")
    out = args.out or Path(__file__).resolve().parents[2] / "results" / f"gpu_training_{slug}.json"
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
