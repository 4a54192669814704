"""slime_corr against verl's rollout correction, side by side in one process, on the same inputs.

verl's real code comes from its PyPI wheel at run time (`pip download --no-deps verl==VERSION` into the git-ignored
`bench/.cache/verl/`); only the imports it makes and these rows never use are stubbed (`_stub_modules`). Per row and
size, the script first checks that both give the same weights, masks, loss and gradients and the metrics both define
the same way, then times them interleaved (medians over repeats) with every metric brought to the host, and
measures the peak memory of one call (net allocations seen by the profiler) and counts the aten ops of one call
(`bench/op_count.py`: views and other metadata-only ops aside; on a GPU each is at least one kernel launch).

    MALLOC_TRIM_THRESHOLD_=4294967296 MALLOC_MMAP_THRESHOLD_=1073741824 python bench/vs_verl.py --threads 1
    python bench/vs_verl.py --threads 2 --repeats 41 --rows token_tis,reinforce --sizes 64x8192
    python bench/vs_verl.py --compile      # adds the --rollout-correction-compile path (fused torch.compile)
    python bench/vs_verl.py --device cuda --compile   # on a GPU (peak memory: torch.cuda's allocator)
    python bench/vs_verl.py --revision HEAD --clock cpu   # this working tree against its last commit, bit for bit
    python bench/vs_verl.py --threads 1 --sizes 64x8192 --markdown docs/benchmarks.md   # also rewrites its table there

A ratio > 1 means slime_corr is faster (verl time / ours) or uses less memory (verl peak / ours).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from markdown_table import caption_line, write_block  # bench/markdown_table.py
from op_count import count_ops, cuda_profile  # bench/op_count.py

from slime_corr.config import RolloutCorrectionConfig
from slime_corr.correction import compute_rollout_correction, metrics_to_host
from slime_corr.losses import compute_policy_loss

VERL_VERSION = "0.9.1"
CACHE = Path(__file__).resolve().parent / ".cache" / "verl"
SIZES = ((64, 8192), (256, 2048), (8, 32768))
DEVICE = torch.device("cpu")  # --device


# ---------------------------------------------------------------------------------------------- verl at run time
def fetch_verl(version: str = VERL_VERSION, cache: Path = CACHE) -> Path:
    """The unpacked verl wheel (downloaded once into `cache`); returns the directory that holds `verl/`."""
    root = cache / f"verl-{version}"
    if (root / "verl" / "trainer" / "ppo" / "rollout_corr_helper.py").is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    wheels = sorted(cache.glob(f"verl-{version}-*.whl"))
    if not wheels:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", f"verl=={version}",
                        "-d", str(cache)], check=True)
        wheels = sorted(cache.glob(f"verl-{version}-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as wheel:
        wheel.extractall(root, members=[n for n in wheel.namelist() if n.startswith("verl/")])
    return root


def _module(name: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__dict__.update(attrs)
    return module


class _Placeholder:
    """A name verl imports for type annotations or code paths these rows never reach."""


class _DataProto:
    """verl.protocol.DataProto.from_dict as these rows read it (`.batch[key]`); the real one needs ray."""

    def __init__(self, tensors: dict[str, Tensor]) -> None:
        self.batch = tensors

    @classmethod
    def from_dict(cls, tensors: dict[str, Tensor], **_: Any) -> _DataProto:
        return cls(tensors)


def _deprecated(replacement: str = "") -> Callable[[Any], Any]:
    return lambda obj: obj


def _stub_modules(root: Path) -> dict[str, types.ModuleType]:
    """Packages whose __init__ would import verl's whole trainer (ray, hydra, ...) are replaced by bare packages
    over the real directories, so the real submodules load; third-party names verl imports but these rows do not
    use are stubbed only when not installed."""
    pkg = root / "verl"
    stubs: dict[str, types.ModuleType] = {}
    for name in ("verl", "verl.trainer", "verl.trainer.ppo", "verl.workers", "verl.utils"):
        module = _module(name)
        module.__path__ = [str(pkg.joinpath(*name.split(".")[1:]))]
        stubs[name] = module
    stubs["verl.utils"].__dict__.update(as_torch_index=_Placeholder, group_mean_std=_Placeholder)
    device = DEVICE.type
    stubs["verl.utils.device"] = _module("verl.utils.device", get_device_name=lambda: device,
                                         get_torch_device=lambda: getattr(torch, device))
    stubs["verl.utils.import_utils"] = _module("verl.utils.import_utils", deprecated=_deprecated)
    stubs["verl.protocol"] = _module("verl.protocol", DataProto=_DataProto)
    stubs["verl.trainer.config"] = _module("verl.trainer.config", AlgoConfig=_Placeholder)
    stubs["verl.trainer.config.algorithm"] = _module("verl.trainer.config.algorithm",
                                                     RolloutCorrectionConfig=_Placeholder)
    stubs["verl.workers.config"] = _module("verl.workers.config", ActorConfig=_Placeholder)
    stubs["verl.workers.config.actor"] = _module("verl.workers.config.actor", PolicyLossConfig=_Placeholder)
    third_party = {"tensordict": "TensorDict", "transformers": "PreTrainedTokenizer", "omegaconf": "DictConfig"}
    for name, attr in third_party.items():
        if name not in sys.modules and importlib.util.find_spec(name) is None:  # (a stub of an earlier load: kept)
            stubs[name] = _module(name, **{attr: _Placeholder})
    return stubs


def load_verl(version: str = VERL_VERSION, cache: Path = CACHE) -> types.SimpleNamespace:
    """verl's real `rollout_corr_helper` and `core_algos` modules (see `_stub_modules`)."""
    root = fetch_verl(version, cache)
    for name, module in _stub_modules(root).items():
        sys.modules.setdefault(name, module)
    return types.SimpleNamespace(
        version=version,
        rc=importlib.import_module("verl.trainer.ppo.rollout_corr_helper"),
        algos=importlib.import_module("verl.trainer.ppo.core_algos"),
    )


def load_verl_module(name: str, version: str = VERL_VERSION, cache: Path = CACHE) -> types.ModuleType:
    """One of verl's real modules (e.g. "verl.utils.torch_functional"), loaded as `load_verl` loads its own."""
    root = fetch_verl(version, cache)
    for stub_name, module in _stub_modules(root).items():
        sys.modules.setdefault(stub_name, module)
    return importlib.import_module(name)


class _ActorConfig(dict):
    """The fields of verl's ActorConfig its policy losses read."""

    def __init__(self, clip_ratio: float, rollout_correction: dict[str, Any] | None = None) -> None:
        super().__init__(clip_ratio_c=3.0)
        self.clip_ratio, self.clip_ratio_low, self.clip_ratio_high = clip_ratio, None, None
        self.global_batch_info: dict[str, Any] = {}
        self.policy_loss = {"rollout_correction": rollout_correction}


# ---------------------------------------------------------------------------------------------- rows
@dataclasses.dataclass(frozen=True)
class Row:
    """One configuration, as slime_corr config and verl arguments.

    kind: "correction" (weights, mask, metrics; no grad), "ppo" (decoupled PPO + IS weights, forward+backward),
    "reinforce" (bypass REINFORCE with IS, forward+backward). `same_metrics`: our key -> verl key, for the metrics
    both define the same way (checked within `METRIC_TOL`; not `mis_weight_std`, which verl computes as
    E[w²] - E[w]² in float32, off by its cancellation). `exact_weights=False` where the weights are divided by a
    batch mean: verl's is a float32 Σw / (n + 1e-8), ours a float64 Σw / n, so they may differ in the last bit.
    """

    name: str
    config: RolloutCorrectionConfig
    verl: dict[str, Any]
    kind: str = "correction"
    same_metrics: tuple[tuple[str, str], ...] = ()
    exact_weights: bool = True


MISMATCH = (("mismatch_kl", "kl"), ("mismatch_k3_kl", "k3_kl"), ("mismatch_training_ppl", "training_ppl"),
            ("mismatch_training_log_ppl", "training_log_ppl"), ("mismatch_rollout_ppl", "rollout_ppl"),
            ("mismatch_rollout_log_ppl", "rollout_log_ppl"), ("mismatch_log_ppl_diff", "log_ppl_diff"),
            ("mismatch_log_ppl_abs_diff", "log_ppl_abs_diff"), ("mismatch_ppl_ratio", "ppl_ratio"),
            ("mismatch_chi2_token", "chi2_token"), ("mismatch_chi2_seq", "chi2_seq"))
TOKEN_IS = (("mis_weight_max", "rollout_is_max"), ("mis_weight_min", "rollout_is_min"),
            ("mis_truncate_fraction", "rollout_is_ratio_fraction_high"), ("mis_ess", "rollout_is_eff_sample_size"))
TOKEN_TIS = dict(rollout_is="token", rollout_is_threshold=2.0)
SEQ_TIS = dict(rollout_is="sequence", rollout_is_threshold=2.0)


def rows() -> list[Row]:
    C = RolloutCorrectionConfig
    token_tis = C(use_tis=True, tis_level="token", tis_upper_bound=2.0)
    return [
        Row("token TIS", token_tis, TOKEN_TIS, same_metrics=MISMATCH + TOKEN_IS + (("mis_ratio_mean_after_mis",
                                                                                  "rollout_is_mean"),)),
        Row("sequence TIS", C(use_tis=True, tis_level="sequence", tis_upper_bound=2.0), SEQ_TIS,
            same_metrics=MISMATCH),
        Row("geometric RS", C(use_rs=True, rs_level="geometric", rs_upper_bound=1.001),
            dict(rollout_rs="seq_mean_k1", rollout_rs_threshold=f"{1 / 1.001!r}_1.001"), same_metrics=MISMATCH),
        Row("token TIS + batch norm", token_tis.replace(tis_batch_normalize=True),
            dict(TOKEN_TIS, rollout_is_batch_normalize=True), exact_weights=False,
            same_metrics=MISMATCH + (("mis_batch_norm_factor", "rollout_is_batch_norm_factor"),)),
        Row("metrics only", C(get_mismatch_metrics=True), dict(rollout_is=None), same_metrics=MISMATCH),
        Row("PPO + token TIS, fwd+bwd", token_tis.replace(eps_clip_c=3.0), TOKEN_TIS, kind="ppo",
            same_metrics=MISMATCH + TOKEN_IS + (("ppo_kl", "actor/ppo_kl"), ("pg_clipfrac", "actor/pg_clipfrac"))),
        Row("REINFORCE + seq IS, fwd+bwd", C.preset("pg_is"), dict(SEQ_TIS, loss_type="reinforce"), kind="reinforce",
            same_metrics=MISMATCH + (("mismatch_kl", "actor/ppo_kl"),)),
    ]


ROW_KEYS = {"token_tis": 0, "seq_tis": 1, "geo_rs": 2, "token_tis_bn": 3, "metrics": 4, "ppo": 5, "reinforce": 6}


def make_inputs(batch: int, seq: int, seed: int = 0) -> dict[str, Tensor]:
    """fp32 log-probs with a small train/rollout mismatch (1% of tokens far off, so bounds bite), uneven lengths."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch, seq)
    old = -torch.rand(shape, generator=g) * 3
    far = (torch.rand(shape, generator=g) < 0.01).float()
    ro = old + 0.01 * torch.randn(shape, generator=g) + far * 0.5 * torch.randn(shape, generator=g)
    lp = old + 0.01 * torch.randn(shape, generator=g)
    lengths = torch.randint(seq // 4, seq + 1, (batch,), generator=g)
    mask = (torch.arange(seq)[None, :] < lengths[:, None]).float()
    x = dict(lp=lp, old=old, ro=ro, adv=torch.randn(shape, generator=g), mask=mask)
    return {k: v.to(DEVICE) for k, v in x.items()}


# ---------------------------------------------------------------------------------------------- the two sides
THIS_CHECKOUT = types.SimpleNamespace(compute_rollout_correction=compute_rollout_correction,
                                      compute_policy_loss=compute_policy_loss, metrics_to_host=metrics_to_host)


def load_revision(revision: str) -> types.SimpleNamespace:
    """`revision`'s slime_corr, imported as slime_corr_base (`vs_revision.import_revision`), as `run_ours` uses it."""
    from vs_revision import import_revision  # bench/vs_revision.py

    config, losses, correction = import_revision(revision, Path(tempfile.mkdtemp(prefix="vs_verl_revision_")))
    return types.SimpleNamespace(compute_rollout_correction=correction.compute_rollout_correction,
                                 compute_policy_loss=losses.compute_policy_loss,
                                 metrics_to_host=correction.metrics_to_host, config_class=config.RolloutCorrectionConfig)


def run_ours(row: Row, x: dict[str, Tensor], config: Any = None, side: types.SimpleNamespace = THIS_CHECKOUT
             ) -> dict[str, Any]:
    """One call with every metric on the host; returns weights, mask, metrics (and loss, grad for loss rows).
    `side`: this checkout's slime_corr, or an earlier revision's (`load_revision`, with its own `config`)."""
    cfg = config or row.config
    if row.kind == "correction":
        with torch.no_grad():
            res = side.compute_rollout_correction(x["old"], x["ro"], x["mask"], cfg)
            return dict(weights=res.weights, mask=res.loss_mask, metrics=side.metrics_to_host(res.metrics))
    lp = x["lp"].detach().requires_grad_(True)
    out = side.compute_policy_loss(lp, x["old"] if row.kind == "ppo" else None, x["ro"], x["adv"], x["mask"], cfg)
    out.loss.backward()
    corr = out.correction
    return dict(weights=corr.weights, mask=corr.loss_mask, loss=out.loss.detach(), grad=lp.grad,
                metrics=side.metrics_to_host({**out.metrics, "loss": out.loss}))


def bit_differences(ours: dict[str, Any], theirs: dict[str, Any]) -> list[str]:
    """What differs between two `run_ours` results, bit for bit ([] = identical): tensors (dtype, shape, values;
    NaN equals NaN), metric names in order and their host values."""
    problems = []
    for key in ours.keys() - {"metrics"}:
        a, b = ours[key], theirs[key]
        same = (a is None) == (b is None) and (a is None or (a.dtype == b.dtype and a.shape == b.shape and torch.equal(
            a.nan_to_num(), b.nan_to_num()) and torch.equal(a.isnan(), b.isnan())))
        if not same:
            problems.append(key)
    if list(ours["metrics"]) != list(theirs["metrics"]):
        problems.append("metric names")
    problems += [k for k, v in ours["metrics"].items() if k in theirs["metrics"] and not (
        v == theirs["metrics"][k] or (v != v and theirs["metrics"][k] != theirs["metrics"][k]))]
    return problems


def run_verl(verl: types.SimpleNamespace, row: Row, x: dict[str, Tensor]) -> dict[str, Any]:
    """verl's own entry points for the same work (its metrics are host floats already)."""
    strip = len("rollout_corr/")
    kwargs = {k: v for k, v in row.verl.items() if k != "loss_type"}
    if row.kind == "correction":
        with torch.no_grad():
            w, mask, metrics = verl.rc.compute_rollout_correction_and_rejection_mask(
                old_log_prob=x["old"], rollout_log_prob=x["ro"], response_mask=x["mask"], **kwargs)
        return dict(weights=None if w is None else w.batch["rollout_is_weights"], mask=mask,
                    metrics={k[strip:]: v for k, v in metrics.items()})
    lp = x["lp"].detach().requires_grad_(True)
    if row.kind == "ppo":
        with torch.no_grad():
            w, mask, metrics = verl.rc.compute_rollout_correction_and_rejection_mask(
                old_log_prob=x["old"], rollout_log_prob=x["ro"], response_mask=x["mask"], **kwargs)
        metrics = {k[strip:]: v for k, v in metrics.items()}
        weights = w.batch["rollout_is_weights"]
        loss, pg = verl.algos.compute_policy_loss_vanilla(
            old_log_prob=x["old"], log_prob=lp, advantages=x["adv"], response_mask=mask,
            loss_agg_mode="token-mean", config=_ActorConfig(0.2), rollout_is_weights=weights)
    else:  # bypass REINFORCE: verl computes the correction inside its loss
        weights, mask = None, None
        cfg = _ActorConfig(0.2, rollout_correction=dict(row.verl))
        loss, metrics = verl.algos.compute_policy_loss_bypass_mode(
            old_log_prob=x["ro"], log_prob=lp, advantages=x["adv"], response_mask=x["mask"],
            loss_agg_mode="token-mean", config=cfg)
        pg = {k: v for k, v in metrics.items() if k.startswith("actor/")}
        metrics = {k[strip:] if k.startswith("rollout_corr/") else k: v for k, v in metrics.items()}
    loss.backward()
    metrics.update(pg)
    return dict(weights=weights, mask=mask, loss=loss.detach(), grad=lp.grad, metrics=metrics)


# ---------------------------------------------------------------------------------------------- equality check
METRIC_TOL = 1e-6
COMPILED_TOL = 1e-5  # the compiled path sums in another order: exp(2·Σlr) of chi2_seq amplifies float32 rounding


def compare(row: Row, ours: dict[str, Any], theirs: dict[str, Any], exact: bool = True) -> list[str]:
    """Differences between the two sides' results ([] = they agree): weights and masks must be bit-equal (where
    verl returns them; `exact=False` for the compiled path, whose exp rounds differently), loss and gradient equal
    to float32 rounding, shared metrics within `METRIC_TOL` (`COMPILED_TOL` for the compiled path)."""
    problems: list[str] = []

    def tensors(name: str, a: Tensor | None, b: Tensor | None, exact: bool) -> None:
        if b is None:
            return
        if a is None:
            problems.append(f"{name}: ours is None, verl's is not")
            return
        a, b = a.detach().to(torch.float64), b.detach().to(torch.float64)
        if a.shape != b.shape:
            problems.append(f"{name}: shape {tuple(a.shape)} vs verl's {tuple(b.shape)}")
        elif exact and not torch.equal(a, b):
            problems.append(f"{name}: max |diff| {(a - b).abs().max().item():.3g} (must be bit-equal)")
        elif not exact and not torch.allclose(a, b, rtol=1e-5, atol=1e-9):
            problems.append(f"{name}: max |diff| {(a - b).abs().max().item():.3g}")

    tensors("weights", ours["weights"], theirs["weights"], exact=exact and row.exact_weights)
    tensors("mask", ours["mask"], theirs["mask"], exact=True)
    if row.kind != "correction":
        tensors("loss", ours["loss"], theirs["loss"], exact=False)
        tensors("grad", ours["grad"], theirs["grad"], exact=False)
    tol = METRIC_TOL if exact else COMPILED_TOL
    for key, verl_key in row.same_metrics:
        a, b = ours["metrics"][key], theirs["metrics"][verl_key]
        if abs(a - b) > tol * max(1.0, abs(b)):
            problems.append(f"metric {key}={a!r} vs verl {verl_key}={b!r}")
    return problems


# ---------------------------------------------------------------------------------------------- timing, memory
def peak_bytes(fn: Callable[[], object]) -> int:
    """Peak of the net bytes allocated during one call (profiler allocation timeline; outputs still alive count;
    on CUDA the caching allocator's peak above what was allocated before the call)."""
    from torch.profiler import ProfilerActivity, profile

    if DEVICE.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    steps = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events() if e.self_cpu_memory_usage)
    return max(itertools.accumulate(s[1] for s in steps), default=0)


def _synced(fn: Callable[[], object]) -> object:
    out = fn()
    torch.cuda.synchronize()
    return out


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, clock: Callable[[], float] = time.perf_counter
                ) -> dict[str, float]:
    """Median seconds per function; the functions alternate within each round so machine noise hits all alike, in
    forward order on even rounds and in reverse on odd ones (what runs just before a call changes its caches)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    names = list(fns)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            t0 = clock()
            fns[name]()
            times[name].append(clock() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=41)
    p.add_argument("--rows", default=",".join(ROW_KEYS), help="comma list of " + ", ".join(ROW_KEYS))
    p.add_argument("--sizes", default=",".join(f"{b}x{s}" for b, s in SIZES))
    p.add_argument("--compile", action="store_true", help="also time --rollout-correction-compile (torch.compile)")
    p.add_argument("--fused", action="store_true", help="also time --rollout-correction-backend triton (the token pass "
                   "as one Triton kernel; on a CPU without triton it falls back to the eager pass)")
    p.add_argument("--cuda-graph", action="store_true",
                   help="also time --rollout-correction-cuda-graph (the correction replayed from a CUDA graph)")
    p.add_argument("--revision", metavar="REV", help="also time this checkout's slime_corr at git revision REV "
                   "(e.g. HEAD, for uncommitted changes), after checking it gives bit-identical results")
    p.add_argument("--verl-version", default=VERL_VERSION)
    p.add_argument("--device", default="cpu", help="where the tensors live: cpu (default), cuda, cuda:1, ...")
    p.add_argument("--kernel-table", type=int, default=0, metavar="N",
                   help="on CUDA: after each row, our N kernels with the most GPU time (torch.profiler); with "
                        "--markdown also the block bench/vs_verl.py cuda kernels")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: perf_counter (the numbers to report); cpu: this thread's CPU time, which other "
                        "processes on a shared machine disturb less (for A/B work; with --threads 1 only)")
    p.add_argument("--markdown", metavar="FILE", help="also write the table into FILE between its markers (block "
                   "bench/vs_verl.py, or bench/vs_verl.py cuda on a GPU; see bench/markdown_table.py)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)
    verl = load_verl(args.verl_version)
    revision = load_revision(args.revision) if args.revision else None
    all_rows = rows()
    selected = [all_rows[ROW_KEYS[k]] for k in args.rows.split(",")]
    sizes = [tuple(int(v) for v in s.split("x")) for s in args.sizes.split(",")]
    malloc = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_")) or "glibc defaults"
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "cpu"
    print(f"verl {verl.version} | torch {torch.__version__} | device {where} | threads={torch.get_num_threads()} | "
          f"repeats={args.repeats} (medians, interleaved) | clock: {args.clock} | malloc: {malloc}")
    head = ["config", "size", "ours ms", "verl ms", "verl/ours", "peak ours MiB", "peak verl MiB", "ops ours",
            "ops verl"]
    if args.compile:
        head += ["compiled ms", "verl/compiled"]
    if args.fused:
        head += ["fused ms", "verl/fused", "ops fused"]
    if args.cuda_graph:
        head += ["graphed ms", "verl/graphed"]
    if revision is not None:
        head += [f"{args.revision} ms", f"{args.revision}/ours", f"ops {args.revision}"]
    if DEVICE.type == "cuda":  # torch.profiler: device activities, their summed time, host syncs (ours / verl)
        head += ["kernels ours / verl", "GPU busy ms ours / verl", "syncs ours / verl"]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    table: list[list[str]] = []
    kernel_rows: list[list[str]] = []  # --kernel-table: (config, size, kernel, ms)
    failed = False
    for row in selected:
        compiled_cfg = row.config.replace(rollout_correction_compile=True) if args.compile else None
        graph_cfg = row.config.replace(rollout_correction_cuda_graph=True) if args.cuda_graph else None
        fused_cfg = row.config.replace(rollout_correction_backend="triton") if args.fused else None
        for b, s in sizes:
            x = make_inputs(b, s)
            problems = compare(row, run_ours(row, x), run_verl(verl, row, x))
            if compiled_cfg is not None:
                problems += [f"compiled {p}" for p in compare(row, run_ours(row, x, compiled_cfg),
                                                              run_verl(verl, row, x), exact=False)]
            if graph_cfg is not None:
                problems += [f"graphed {p}" for p in compare(row, run_ours(row, x, graph_cfg), run_verl(verl, row, x))]
            if fused_cfg is not None:
                problems += [f"fused {p}" for p in compare(row, run_ours(row, x, fused_cfg), run_verl(verl, row, x),
                                                           exact=False)]
            if revision is not None:
                revision_cfg = revision.config_class.from_dict(row.config.to_dict())
                problems += [f"{args.revision} differs: {p}" for p in bit_differences(
                    run_ours(row, x), run_ours(row, x, revision_cfg, revision))]
            if problems:
                failed = True
                print(f"| {row.name} | {b}x{s} | DIFFERENT: {'; '.join(problems)} |")
                table.append([row.name, f"{b}x{s}", f"DIFFERENT: {'; '.join(problems)}"] + [""] * (len(head) - 3))
                continue
            fns: dict[str, Callable[[], object]] = {"ours": partial(run_ours, row, x),
                                                    "verl": partial(run_verl, verl, row, x)}
            if compiled_cfg is not None:
                fns["compiled"] = partial(run_ours, row, x, compiled_cfg)
            if graph_cfg is not None:
                fns["graphed"] = partial(run_ours, row, x, graph_cfg)
            if fused_cfg is not None:
                fns["fused"] = partial(run_ours, row, x, fused_cfg)
            if revision is not None:
                fns["revision"] = partial(run_ours, row, x, revision_cfg, revision)
            unsynced = fns
            if DEVICE.type == "cuda":  # the time until the device is done, not until the launches are queued
                fns = {name: partial(_synced, fn) for name, fn in fns.items()}
            t = interleaved(fns, args.repeats, time.perf_counter if args.clock == "wall" else time.thread_time)
            mem = {name: peak_bytes(fn) / 2**20 for name, fn in fns.items()}
            ops = {name: count_ops(fns[name]).total for name in ("ours", "verl", "fused", "revision") if name in fns}
            cells = [row.name, f"{b}x{s}", f"{t['ours'] * 1e3:.2f}", f"{t['verl'] * 1e3:.2f}",
                     f"{t['verl'] / t['ours']:.2f}x", f"{mem['ours']:.1f}", f"{mem['verl']:.1f}", str(ops["ours"]),
                     str(ops["verl"])]
            if compiled_cfg is not None:
                cells += [f"{t['compiled'] * 1e3:.2f}", f"{t['verl'] / t['compiled']:.2f}x"]
            if fused_cfg is not None:
                cells += [f"{t['fused'] * 1e3:.2f}", f"{t['verl'] / t['fused']:.2f}x", str(ops["fused"])]
            if graph_cfg is not None:
                cells += [f"{t['graphed'] * 1e3:.2f}", f"{t['verl'] / t['graphed']:.2f}x"]
            if revision is not None:
                cells += [f"{t['revision'] * 1e3:.2f}", f"{t['revision'] / t['ours']:.2f}x", str(ops["revision"])]
            top = None
            if DEVICE.type == "cuda":
                (ko, bo, so, top), (kv, bv, sv, _) = (cuda_profile(unsynced[name]) for name in ("ours", "verl"))
                cells += [f"{ko} / {kv}", f"{bo:.2f} / {bv:.2f}", f"{so} / {sv}"]
            table.append(cells)
            line = "| " + " | ".join(cells) + " |"
            if top is not None and args.kernel_table:
                line += "\n" + "\n".join(f"|   | {ms:.3f} ms | {name} |" for name, ms in top.most_common(
                    args.kernel_table))
                kernel_rows += [[row.name, f"{b}x{s}", name, f"{ms:.3f}"]
                                for name, ms in top.most_common(args.kernel_table)]
            print(line, flush=True)
    if args.markdown:
        caption = caption_line(sys.argv, where, torch.get_num_threads(),
                               f"verl {verl.version}, torch {torch.__version__}, medians of {args.repeats} interleaved "
                               f"repeats, clock {args.clock}, every metric on the host; verl/x > 1: ours is faster")
        name = "vs_verl.py" if DEVICE.type == "cpu" else f"vs_verl.py {DEVICE.type}"
        write_block(args.markdown, name, caption, head, table,
                    title=f"The correction against verl's ({name.replace('vs_verl.py', 'bench/vs_verl.py')})")
        if kernel_rows:
            write_block(args.markdown, f"{name} kernels", caption, ["config", "size", "kernel (ours)", "GPU ms"],
                        kernel_rows, title=f"The correction's largest kernels (bench/{name} kernels)")
    if failed:
        sys.exit("some rows differ from verl (see DIFFERENT above)")


if __name__ == "__main__":
    main()
