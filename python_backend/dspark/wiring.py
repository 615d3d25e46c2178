"""The one place that turns a serving spec into running parts: target, drafter (with its STS
temperatures), scheduler policy and SPS table, and the engine over them.

Every entry point builds through here: the CLI commands (`generate`, `bench`, `eval`,
`calibrate`, `profile-sps`, ...), and the Triton models (whose `config.pbtxt` parameters are
the spec). Resolution order, lowest first: the defaults of `Spec`, the `config.pbtxt`
parameters, the documented `DSPARK_*` environment variables (tests and `dspark serve` use
them), explicit keyword overrides (CLI flags).

Model names: `smollm2` (the default: SmolLM2-135M-Instruct, fetched by `make setup`),
`demo` (the 10M demo target in build/demo/target, for fast tests), or a Hugging Face folder.
Drafter names: `none`, `auto` (the model's shipped default drafter if it has one, else
none), `ngram[:N]`, a drafter name under the model's drafter folder, a drafter folder, or a
hybrid `ngram[:N]+<trained>` (e.g. `ngram+auto`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from dspark import paths

MODEL_ALIASES: dict[str, Path] = {"smollm2": paths.SMOLLM2, "demo": paths.DEMO_TARGET}
# Trained drafters shipped per model (folder names under these are drafter names).
DRAFTER_DIRS: dict[str, Path] = {"smollm2": paths.SMOLLM2_DRAFTERS, "demo": paths.DEMO_DRAFTERS}
DEFAULT_DRAFTER = "dspark-markov"
# Profiled steps-per-second tables per model on the CPU (`dspark profile-sps`), from the team's
# AMX machines; a table profiled on another kind of CPU sits beside it (`sps_table_path`).
SHIPPED_CPU_KIND = "amx"
SPS_TABLES: dict[str, Path] = {"smollm2": paths.RESULTS / "sps_smollm2_cpu.json",
                               "demo": paths.RESULTS / "sps_cpu.json"}
DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
          "q4_1": torch.bfloat16}
# dtype names that keep the GGUF's quantized weights (dspark.runtime.quant); the value above is
# the activation dtype they run with.
QUANTIZED = {"q4_1": "q4_1"}
# What `dtype=auto` means on the CPU, per model: the faster one on this CPU for the shapes
# served, measured by `dspark bench-target` (results/target_bench_smollm2.json); the demo target
# keeps fp32 (its step is op-overhead bound, and its drafters were trained on fp32 features).
# bf16 only where oneDNN has bf16 kernels (`linear.has_bf16_matmul`); fp32 on an AVX2-only CPU.
AUTO_CPU_DTYPE: dict[str, torch.dtype] = {"smollm2": torch.bfloat16, "demo": torch.float32}
# What `num_threads=0` means on the CPU: 1 intra-op thread. Measured (`dspark bench-target`,
# results/target_bench_smollm2.json "decode_tokens_per_s_by_threads"): 2 OpenMP threads gain
# ~13 % at batch 1 on an idle 2-core machine but collapse when anything else runs on it
# (batch 32: 44 instead of 335 tok/s: the spinning threads wait on each other), and every SPS
# table the scheduler reads is profiled at 1 thread. Pass num_threads to override.
AUTO_CPU_THREADS = 1


@dataclass(frozen=True)
class Spec:
    """Everything needed to build an engine. String-typed where config.pbtxt is."""

    model: str = "smollm2"  # smollm2 | demo | HF folder
    dtype: str = "auto"  # auto | fp32 | bf16 | fp16 | q4_1 (the GGUF's int4 weights, CPU)
    device: str = "auto"  # auto (cuda when available) | cpu | cuda[:N]
    capacity: int = 8  # KV slots = requests decoded together
    max_seq_len: int = 2048  # tokens per slot (prompt + output)
    num_threads: int = 0  # torch intra-op threads on the CPU (0 = AUTO_CPU_THREADS)
    drafter: str = "auto"  # auto | none | ngram[:N] | drafter name | drafter folder | ngram[:N]+<trained>
    policy: str = "dspark"  # none | fixed:k | mtp1 | threshold:t | dspark-theory | dspark
    gamma: int = 7  # draft block size γ
    sps: str = "auto"  # auto | gpu_shaped | path to an sps.json
    max_batch_tokens: int = 4096  # cap on Σ(1 + ℓ_r) per step

    @property
    def model_key(self) -> str | None:
        """`smollm2` / `demo` when the model is (or resolves to) one of the aliases."""
        if self.model in MODEL_ALIASES:
            return self.model
        p = Path(self.model).resolve()
        return next((k for k, v in MODEL_ALIASES.items() if v.resolve() == p), None)


ENV_VARS: dict[str, str] = {f.name: "DSPARK_" + f.name.upper() for f in fields(Spec)}


def resolve(params: Mapping[str, Any] | None = None, env: Mapping[str, str] | None = None,
            **overrides: Any) -> Spec:
    """Spec from defaults < params (config.pbtxt) < env (DSPARK_*) < overrides (None = unset).
    Raises ValueError naming the field when a value does not parse."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {}
    for layer in (params or {}, {k: env[v] for k, v in ENV_VARS.items() if env.get(v)},
                  {k: v for k, v in overrides.items() if v is not None}):
        for key, value in layer.items():
            if key not in ENV_VARS:
                raise ValueError(f"unknown setting {key!r} (known: {', '.join(ENV_VARS)})")
            if value is None or value == "":
                continue
            values[key] = value
    out = Spec()
    for f in fields(Spec):
        if f.name in values:
            raw = values[f.name]
            try:
                cast: int | str = int(raw) if f.type == "int" else str(raw)
            except (TypeError, ValueError):
                raise ValueError(f"setting {f.name!r}: expected an integer, got {raw!r}") from None
            changes: dict[str, Any] = {f.name: cast}
            out = replace(out, **changes)
    return out


def pbtxt_params(model_config: Mapping[str, Any]) -> dict[str, str]:
    """The `parameters` of a Triton model config (as the Python backend passes it) as a dict."""
    return {k: v.get("string_value", "") for k, v in model_config.get("parameters", {}).items()}


# ---- parts ----

def model_folder(model: str) -> Path:
    """Alias or folder -> checkpoint folder; FileNotFoundError with the fix when it is missing."""
    folder = MODEL_ALIASES.get(model, Path(model))
    if not (folder / "config.json").is_file():
        hints = {"smollm2": "run `make setup` (or `dspark fetch-model`) to fetch and convert it",
                 "demo": "rebuild it with `make demo-assets`"}
        hint = hints.get(model, "pass a Hugging Face checkpoint folder")
        raise FileNotFoundError(f"model {model!r}: no config.json in {folder}; {hint}")
    return folder


def torch_device(spec: Spec) -> torch.device:
    if spec.device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec.device)


def torch_dtype(spec: Spec, device: torch.device | None = None) -> torch.dtype:
    """The dtype the spec's target computes in (its activations and KV cache): `torch_dtypes`."""
    return torch_dtypes(spec, device)[0]


def torch_dtypes(spec: Spec, device: torch.device | None = None) -> tuple[torch.dtype, torch.dtype]:
    """(activations, weights) of the spec's target on its device. They differ in one case: bf16 on
    a CPU without bf16 matmuls where our rows kernel runs (AVX2 only). There bf16 activations
    would run oneDNN's reference kernels (a verify 2.3x slower than fp32, README "On an AVX2-only
    CPU"), so the weights are rounded to bf16, which the kernel streams as bf16 (half the bytes),
    and every activation stays fp32."""
    device = device or torch_device(spec)
    dtype = _requested_dtype(spec, device)
    if dtype == torch.bfloat16 and spec.dtype not in QUANTIZED and device.type == "cpu":
        from dspark.runtime.linear import has_bf16_matmul, serving_cpu_gemm

        if not has_bf16_matmul() and serving_cpu_gemm(torch.float32) == "rows":
            return torch.float32, torch.bfloat16
    return dtype, dtype


def _requested_dtype(spec: Spec, device: torch.device) -> torch.dtype:
    if spec.dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        from dspark.runtime.linear import has_bf16_matmul

        dtype = AUTO_CPU_DTYPE.get(spec.model_key or "", torch.float32)
        return dtype if dtype != torch.bfloat16 or has_bf16_matmul() else torch.float32
    if spec.dtype not in DTYPES:
        raise ValueError(f"setting 'dtype': unknown {spec.dtype!r} (auto, {', '.join(DTYPES)})")
    return DTYPES[spec.dtype]


def cpu_threads(spec: Spec) -> int:
    """The torch intra-op threads a CPU target of this spec runs with: its own, else AUTO_CPU_THREADS."""
    return spec.num_threads or AUTO_CPU_THREADS


def set_threads(spec: Spec, device: torch.device) -> None:
    """torch's intra-op threads for this process: the spec's, else AUTO_CPU_THREADS on the CPU."""
    threads = cpu_threads(spec) if device.type == "cpu" else spec.num_threads
    if threads > 0:
        torch.set_num_threads(threads)


def load_target(spec: Spec, num_taps: int = 3, compile: bool = False,
                activations: torch.dtype | None = None):
    """The in-process target engine (`TargetEngine`) described by the spec (compile: see
    `TargetEngine`; off by default, a benchmark option). `activations` forces weights and
    activations to that dtype instead of `torch_dtypes` (`dspark bench-min-rows` times oneDNN's
    bf16 matmuls, also where bf16 would otherwise mean bf16 weights only)."""
    from dspark.runtime.target import TargetEngine

    device = torch_device(spec)
    set_threads(spec, device)
    quant = QUANTIZED.get(spec.dtype)
    if quant is not None and device.type != "cpu":
        raise ValueError(f"setting 'dtype': {spec.dtype} runs torch's CPU int4 kernels; use device cpu")
    dtype, weights_dtype = (activations, activations) if activations else torch_dtypes(spec, device)
    return TargetEngine.from_pretrained(model_folder(spec.model), capacity=spec.capacity,
                                        max_seq_len=spec.max_seq_len, device=device, dtype=dtype,
                                        num_taps=num_taps, quant=quant, compile=compile,
                                        weights_dtype=weights_dtype)


def load_shared_weights(spec: Spec, num_taps: int = 3):
    """The target's embedding, LM head and final norm alone (`SharedWeights`), on the target's
    device and dtype: all a trained drafter needs from its target when it runs in a process
    of its own (the Triton `drafter` model)."""
    from dspark.runtime.loader import SharedWeights

    device = torch_device(spec)
    set_threads(spec, device)
    dtype, weights_dtype = torch_dtypes(spec, device)
    return SharedWeights(model_folder(spec.model), device=device, dtype=dtype, num_taps=num_taps,
                         weights_dtype=weights_dtype)


def drafter_folder(spec: Spec, name: str | None = None) -> Path | None:
    """The folder of a trained drafter name/path for this model (a hybrid's trained part), None
    for ngram / none."""
    name = spec.drafter if name is None else name
    name = name.partition("+")[2] or name
    if name == "auto":
        root = DRAFTER_DIRS.get(spec.model_key or "")
        folder = None if root is None else root / DEFAULT_DRAFTER
        return folder if folder is not None and (folder / "config.json").is_file() else None
    if name == "none" or name.startswith("ngram"):
        return None
    if Path(name).is_dir():
        return Path(name)
    root = DRAFTER_DIRS.get(spec.model_key or "")
    if root is not None and (root / name).is_dir():
        return root / name
    known = [] if root is None or not root.is_dir() else sorted(
        p.name for p in root.iterdir() if (p / "config.json").is_file())
    raise FileNotFoundError(f"drafter {name!r}: not a folder, and not one of this model's drafters "
                            f"({', '.join(known) or 'none shipped'}); "
                            "use none, ngram[:N], ngram+<name> or a folder")


def needs_weights(drafter: str) -> bool:
    """Whether the drafter spec runs a trained drafter (which shares the target's weights)."""
    return drafter != "none" and (not drafter.startswith("ngram") or "+" in drafter)


def load_drafter(spec: Spec, target, name: str | None = None):
    """The drafter (it carries its own STS temperatures) or None for plain decoding."""
    from dspark.runtime.drafter import build_drafter

    name = spec.drafter if name is None else name
    if name == "none":
        return None
    if "+" in name:  # ngram[:N]+<trained>: lookups where the context repeats, the trained drafter elsewhere
        from dspark.runtime.drafter.hybrid import HybridDrafter

        lookup, _, trained = name.partition("+")
        neural = load_drafter(spec, target, trained)
        if not lookup.startswith("ngram") or neural is None or "+" in trained:
            raise ValueError(f"drafter {name!r}: a hybrid is ngram[:N]+<a trained drafter of this model>")
        ngram, _ = build_drafter(lookup, target, neural.gamma)
        return HybridDrafter(ngram, neural, vocab_size=target.vocab_size)
    folder = drafter_folder(spec, name)
    if folder is None and not name.startswith("ngram"):
        return None  # auto, and this model ships no drafter
    drafter, _ = build_drafter(str(folder) if folder is not None else name, target, spec.gamma)
    return drafter


def load_sps(spec: Spec, device: torch.device | None = None):
    """auto = this model's profiled CPU table on the CPU when present (its quantized dtype's own
    when profiled, `sps_table_path`), else the GPU-shaped one."""
    from dspark.runtime.sps import SPSTable

    if spec.sps == "gpu_shaped":
        return SPSTable.gpu_shaped()
    if spec.sps != "auto":
        if not Path(spec.sps).is_file():
            raise FileNotFoundError(f"setting 'sps': no SPS table at {spec.sps} (or use auto / gpu_shaped)")
        return SPSTable.load(spec.sps)
    on_cpu = (device or torch_device(spec)).type == "cpu"
    table = auto_sps_path(spec.model_key, spec.dtype, threads=cpu_threads(spec)) if on_cpu else None
    return SPSTable.load(table) if table is not None else SPSTable.gpu_shaped()


def auto_sps_path(model_key: str | None, dtype: str = "auto", kind: str | None = None,
                  threads: int = 1) -> Path | None:
    """The CPU table `--sps auto` reads: the first that exists of this dtype's table profiled on
    this kind of CPU, this dtype's shipped one, then the same two for the unquantized weights
    (`sps_table_path`); with `threads` > 1 each one's table profiled at that many threads first.
    A step's cost by rows belongs to a CPU kind: on an AMD EPYC without AMX
    a batch-1 verify costs the same for 1 to 6 tokens and +17 % at 8, where the shipped AMX
    table has +44 %, so that table priced the drafts of every batch-1 step too dear there
    (README, "The SPS table the scheduler uses"). It belongs to a thread count too: on an
    AVX2-only CPU a 5-token verify costs ~1.35x a 1-token one on 1 thread, ~1.2x on 2 (README, "Two
    threads"). `kind` defaults to this CPU's (`linear.cpu_kind`)."""
    from dspark.runtime.linear import cpu_kind

    kind = cpu_kind() if kind is None else kind
    counts = [threads, 1] if threads > 1 else [1]
    for dt, k in ((dtype, kind), (dtype, ""), ("auto", kind), ("auto", "")):
        for n in counts:
            table = sps_table_path(model_key, dt, k, n)
            if table is not None and table.is_file():
                return table
    return None


def sps_table_path(model_key: str | None, dtype: str = "auto", kind: str = "",
                   threads: int = 1) -> Path | None:
    """The profiled CPU table of this model in this dtype: SPS_TABLES' own for the bf16 / fp32
    weights, `sps_<model>_<dtype>_cpu.json` beside it for quantized weights (int4 costs grow
    with a verify's rows far faster than bf16's, so a bf16 table would misprice every step) and
    for bf16 on an AVX2-only CPU (bf16 weights in the rows kernel: a one-row step far cheaper
    than fp32's, a verify of 5+ rows alike, `torch_dtypes`);
    for a CPU `kind` other than the shipped tables' (`linear.cpu_kind`, e.g. "avx512bf16"),
    `..._cpu_<kind>.json` (what `dspark profile-sps` writes on such a CPU); profiled at `threads` > 1
    torch threads, `..._t<threads>.json`."""
    table = SPS_TABLES.get(model_key or "")
    if table is None:
        return None
    if dtype in QUANTIZED or dtype == "bf16" and kind == "avx2":
        table = table.with_name(table.name.replace("_cpu.json", f"_{dtype}_cpu.json"))
    if kind and kind != SHIPPED_CPU_KIND:
        table = table.with_name(table.name.replace("_cpu.json", f"_cpu_{kind}.json"))
    if threads > 1:
        table = table.with_name(f"{table.stem}_t{threads}.json")
    return table


def build_engine(spec: Spec, target=None, drafter: Any = "spec"):
    """SpecEngine over the spec's parts (pass `target` / `drafter` to reuse loaded ones;
    drafter=None forces plain decoding)."""
    from dspark.runtime.engine import SpecEngine

    target = load_target(spec) if target is None else target
    if drafter == "spec":
        drafter = load_drafter(spec, target)
    policy = spec.policy if drafter is not None else "none"
    return SpecEngine(target, drafter, policy, max_batch_tokens=spec.max_batch_tokens,
                      sps=load_sps(spec, getattr(target, "device", None)))


def add_arguments(p, **defaults: Any) -> None:
    """The shared CLI flags (`--model`, `--dtype`, `--drafter`, ...); defaults come from Spec."""
    base = replace(Spec(), **defaults)
    help_text = {
        "model": "smollm2 (default model), demo (10M demo target) or a Hugging Face folder",
        "dtype": "auto (the faster on this machine), fp32, bf16, q4_1 (GGUF int4 weights, CPU)",
        "device": "auto, cpu, cuda[:N]",
        "capacity": "KV-cache slots (concurrent requests)", "max_seq_len": "tokens per slot",
        "num_threads": f"torch CPU threads (0 = auto: {AUTO_CPU_THREADS} on the CPU)",
        "drafter": "auto, none, ngram[:N], a shipped drafter name, a drafter folder or ngram[:N]+<trained>",
        "policy": "none, fixed:k, mtp1, threshold:t, dspark-theory, dspark",
        "gamma": "draft block size γ", "sps": "auto, gpu_shaped or an sps.json path",
        "max_batch_tokens": "cap on tokens verified per step"}
    for f in fields(Spec):
        flag = "--" + f.name.replace("_", "-")
        kind = int if f.type == "int" else str
        p.add_argument(flag, type=kind, default=getattr(base, f.name),
                       help=f"{help_text[f.name]} (default: %(default)s)")


def from_args(args: Any) -> Spec:
    """Spec from an argparse namespace filled by `add_arguments`."""
    return Spec(**{f.name: getattr(args, f.name) for f in fields(Spec)})
