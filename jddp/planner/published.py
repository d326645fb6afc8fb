"""Published large-scale training runs the planner reproduces (`python -m jddp.plan
--published`): each with its source, its configuration as published, the utilization it
reports, and how that figure counts FLOPs (each paper its own way, so each is predicted in its
own convention).

One run per device type is the calibration run (`calibration=True`): the device's
`efficiency` (jddp/planner/devices.py) is the value that makes the planner reproduce it, and
that one value is used for every other run on the hardware. Calibration runs are shown, but
are not validation points. Chosen before looking at the predictions: Megatron-LM's 310B row
(the A100 table's middle), MaxText's single-slice rows (no DCN: the least communication).
One more calibrates the TPUs' `step_spread` (how far a step waits for the slowest slice): the
largest multi-slice run of the older system, MaxText 22B on 8x v4-128; TPU v5e's series is
predicted with it.

Runs on one system at several device counts form a series (`series`): one model on more
hosts or slices (MaxText's tables: how utilization falls as the job spans them), or the model
grown with the devices (Megatron-LM's weak scaling: utilization rises as a wider layer's
matmuls outweigh its memory-bound traffic, the attention scores' above all).
`python -m jddp.plan --published` reports each series' drop from its first to its last
point; the rule the tests hold for every series: the predicted drop within a third of the
published one, every point within 15%.
"""

import dataclasses
import functools
import math

from jddp.planner.devices import PRESETS, DeviceProfile
from jddp.planner.layouts import Layout
from jddp.planner.search import plan_row
from jddp.planner.timing import predict
from jddp.planner.workload import Transformer, Workload, transformer_params

MEGATRON = (
    "Narayanan et al. 2021, 'Efficient Large-Scale Language Model Training on GPU Clusters "
    "Using Megatron-LM' (arXiv 2104.04473), Table 1; configuration from Megatron-LM's "
    "examples/academic_paper_scripts/sc21/run_table_1.sh and CONFIG.sh (seq 2048, vocab "
    "51,200, fp16, uniform full recomputation); figures also in Megatron-LM's README, "
    "images/cases_april2021.png"
)
PALM = (
    "Chowdhery et al. 2022, 'PaLM: Scaling Language Modeling with Pathways' (arXiv "
    "2204.02311), sections 2, 4 and 4.1, Tables 1 and 3"
)
MAXTEXT = (
    "MaxText (github.com/AI-Hypercomputer/maxtext) at commit 76bd53b0f (2023-12-15): "
    "MaxText/configs/{v4,v5e}/README.md tables, the {v4/22b,v5e/16b}.sh scripts and base.yml "
    "(vocab 32,768, head_dim 256, relu MLP, tied logits, remat full, flash attention, "
    "bfloat16)"
)


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    quote: str  # the published figure, as printed
    device: str  # a preset of jddp/planner/devices.py
    transformer: Transformer
    layout: Layout  # the published mesh
    global_batch: int
    devices_per_host: int  # devices sharing the fast link (a node's NVLink, a slice's ICI)
    published: float  # the utilization the source reports, as a fraction
    convention: str  # "megatron", "palm" or "maxtext": how the source counts FLOPs
    recompute: float
    microbatches: int = 0
    virtual_stages: int = 1
    exposed_axes: tuple[str, ...] = ()  # reductions the run does not overlap with compute
    regather_in_backward: bool = False
    recompute_drops_output: bool = True
    calibration: bool = False
    calibrates: str = "efficiency"  # or "step_spread": which device figure the run sets
    series: str = ""  # the runs of one model on one system at several sizes share a name

    @functools.cached_property
    def workload(self) -> Workload:
        t, staged = self.transformer, self.layout.stage > 1
        return Workload(
            name=self.name,
            params=transformer_params(t),
            global_batch=self.global_batch,
            model_flops=t.train_flops(self.global_batch),
            transformer=t,
            min_shard_size=1,
            recompute=self.recompute,
            compute_bytes=2,
            comm_bytes=2 if self.convention != "maxtext" else 0,
            # Without stages Megatron's micro-batches are gradient accumulation steps.
            microbatches=self.microbatches if staged else 0,
            grad_accum_steps=1 if staged else (self.microbatches or 1),
            virtual_stages=self.virtual_stages,
            lockstep_pipeline=False,
            pipeline_remat="none",  # another framework's stages: `recompute` says what it redoes
            regather_in_backward=self.regather_in_backward,
            recompute_drops_output=self.recompute_drops_output,
            gathers_whole_model=False,  # FSDP frameworks gather layer by layer
            rules_for=_megatron_rules,
        )

    def published_flops(self) -> float:
        """FLOPs per step as the source counts them for its utilization figure."""
        t, b = self.transformer, self.global_batch
        s, layers, h = t.seq_len, t.layers, t.width
        if self.convention == "megatron":  # Narayanan et al. 2021, eq. (3): with recompute
            return 96 * b * s * layers * h**2 * (1 + s / (6 * h) + t.vocab / (16 * layers * h))
        params = sum(math.prod(x.shape) for x in _leaves(transformer_params(t)))
        attention = 12 * layers * t.attention_width * s * b * s  # 12 L H Q T per token
        if self.convention == "maxtext":  # MaxText train.py: 6 N per token, causal attention
            return 6 * params * b * s + attention / 2
        return 6 * params * b * s + attention  # PaLM appendix B: 6N + 12 L H Q T per token


def _leaves(tree):
    import jax

    return jax.tree.leaves(tree)


def _megatron_rules(mesh):
    """jddp's GPT layout; a multi-query model's queries split like `qkv`, its single key and
    value head replicated over tensor (the default rule)."""
    from jddp.models.gpt import TENSOR_PARALLEL_RULES
    from jddp.parallel.rules import adapt_preset

    return adapt_preset((("attn/q/kernel$", "fsdp,tensor"), *TENSOR_PARALLEL_RULES), mesh)


def _megatron(name, h, layers, heads, tp, pp, mbs, gbs, gpus, percent, vpp_layers=0, **kw):
    # Megatron-LM's 2021 runs: DDP 'local' (no overlap of the gradient all-reduce) above 18B.
    data = gpus // (tp * pp)
    return PublishedRun(
        name=f"Megatron-LM GPT {name}",
        source=MEGATRON,
        quote=f"{name}: {gpus} A100, tensor {tp} x pipeline {pp}, batch {gbs}: {percent}% of "
        "theoretical peak",
        device="a100-80gb",
        transformer=Transformer(
            layers, h, heads, 4 * h, 51200, 2048, dropout=True, attention_dropout=True
        ),
        layout=Layout("zero3", data=data, tensor=tp, stage=pp),
        global_batch=gbs,
        devices_per_host=8,
        published=percent / 100,
        convention="megatron",
        recompute=1.0,
        microbatches=gbs // (mbs * data),
        virtual_stages=layers // (pp * vpp_layers) if vpp_layers else 1,
        exposed_axes=("data",) if kw.pop("ddp_local", True) else (),
        recompute_drops_output=False,  # PyTorch reruns the whole layer
        series="Megatron-LM Table 1 (weak scaling)",
        **kw,
    )


def _maxtext(name, device, t, slices, chips, per_device_batch, mfu, **kw):
    pod = f"{device.removeprefix('tpu-')}-{chips * 2 if device == 'tpu-v4' else chips}"
    return PublishedRun(
        name=f"MaxText {name} on {slices}x {pod}",  # v4 counts 2 cores per chip
        source=MAXTEXT,
        quote=f"{name}, {slices} slice(s): {mfu}% MFU",
        device=device,
        transformer=t,
        layout=Layout("zero3", data=slices, fsdp=chips),
        global_batch=per_device_batch * slices * chips,
        devices_per_host=chips,
        published=mfu / 100,
        convention="maxtext",
        recompute=1.0,
        regather_in_backward=True,
        series=f"MaxText {name} on {pod} slices",
        **kw,
    )


MAXTEXT_22B = Transformer(
    48, 6144, 24, 24576, 32768, 2048, learned_positions=False, biases=False, head_size=256,
    fused_attention=True,
)  # fmt: skip
MAXTEXT_16B = Transformer(
    32, 5120, 32, 32768, 32768, 2048, learned_positions=False, biases=False, head_size=256,
    fused_attention=True,
)  # fmt: skip
# Vocabulary: 256k tokens, padded to 256,008 to split 12 ways (the partitioner pads it).
PALM_540B = Transformer(
    118, 18432, 48, 4 * 18432, 256008, 2048, kv_heads=1, gated_mlp=True,
    learned_positions=False, parallel_block=True, biases=False, head_size=256,
)  # fmt: skip

RUNS: tuple[PublishedRun, ...] = (
    _megatron("1.7B", 2304, 24, 24, 1, 1, 16, 512, 32, 44, ddp_local=False),
    _megatron("3.6B", 3072, 30, 32, 2, 1, 16, 512, 64, 44, ddp_local=False),
    _megatron("7.5B", 4096, 36, 32, 4, 1, 16, 512, 128, 46, ddp_local=False),
    _megatron("18B", 6144, 40, 48, 8, 1, 8, 1024, 256, 43, ddp_local=False),
    _megatron("39B", 8192, 48, 64, 8, 2, 4, 1536, 512, 44),
    _megatron("76B", 10240, 60, 80, 8, 4, 2, 1792, 1024, 45, vpp_layers=5),
    _megatron("145B", 12288, 80, 96, 8, 8, 2, 2304, 1536, 47, vpp_layers=5),
    _megatron("310B", 16384, 96, 128, 8, 16, 1, 2160, 1920, 50, vpp_layers=3, calibration=True),
    _megatron("530B", 20480, 105, 128, 8, 35, 1, 2520, 2520, 52, vpp_layers=1),
    _megatron("1T", 25600, 128, 160, 8, 64, 1, 3072, 3072, 52),
    PublishedRun(
        name="PaLM 540B",
        source=PALM,
        quote="'The MFU of PaLM 540B is 45.7% without self-attention or 46.2% with it'; "
        "6144 TPU v4 in two pods, 'each weight tensor partitioned over 3072 chips using "
        "12-way model parallelism and 256-way fully sharded data parallelism', batch 2048",
        device="tpu-v4",
        transformer=PALM_540B,
        layout=Layout("zero3", data=2, fsdp=256, tensor=12, sequence_parallel=True),
        global_batch=2048,
        devices_per_host=3072,  # a pod's chips share ICI; the pods talk over DCN
        published=0.462,
        convention="palm",
        # HFU 57.8% / MFU 46.2% = (3 + r) / 3: r = 0.753 of the forward is recomputed
        recompute=3 * (57.8 / 46.2 - 1),
        # 'a lack of overlap between the backward pass and the cross-pod gradient reduction'
        exposed_axes=("data",),
        regather_in_backward=True,
    ),
    # MaxText's tables: the same script and per-chip batch on 1, 2, 4, 8 (... 32) slices
    _maxtext("22B", "tpu-v4", MAXTEXT_22B, 1, 64, 16, 56.7, calibration=True),
    _maxtext("22B", "tpu-v4", MAXTEXT_22B, 2, 64, 16, 55.2),
    _maxtext("22B", "tpu-v4", MAXTEXT_22B, 4, 64, 16, 54.3),
    _maxtext(
        "22B", "tpu-v4", MAXTEXT_22B, 8, 64, 16, 53.2, calibration=True, calibrates="step_spread"
    ),
    _maxtext("16B", "tpu-v5e", MAXTEXT_16B, 1, 256, 6, 61.10, calibration=True),
    *(
        _maxtext("16B", "tpu-v5e", MAXTEXT_16B, slices, 256, 6, mfu)
        for slices, mfu in ((2, 59.37), (4, 59.14), (8, 58.27), (16, 56.56), (32, 54.65))
    ),
)


def predicted_utilization(run: PublishedRun, profile: DeviceProfile | None = None) -> dict:
    """The run's utilization as the planner predicts it, in the source's convention."""
    profile = profile or PRESETS[run.device]
    prediction = predict(run.workload, run.layout, profile, run.devices_per_host, run.exposed_axes)
    peak = profile.peak_flops * run.layout.devices
    return {
        "predicted_mfu": run.published_flops() / (prediction.step_s * peak),
        "predicted_step_s": prediction.step_s,
        "prediction": prediction,
    }


def solve_calibration(run: PublishedRun) -> float:
    """The value of the device figure `run` calibrates (`run.calibrates`: `efficiency` or
    `step_spread`) with which the planner reproduces it (bisection; utilization rises with
    efficiency and falls with the spread)."""
    low, high = (0.01, 1.0) if run.calibrates == "efficiency" else (0.0, 0.5)
    rises = run.calibrates == "efficiency"
    for _ in range(60):
        middle = (low + high) / 2
        profile = dataclasses.replace(PRESETS[run.device], **{run.calibrates: middle})
        below = predicted_utilization(run, profile)["predicted_mfu"] < run.published
        if below == rises:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def best_layout(run: PublishedRun) -> dict:
    """The planner's best plan for the run's model, batch, devices and system (the published
    mesh's neighbours included: stages only if the run pipelined)."""
    from jddp.planner.search import layouts_for, rank

    profile = PRESETS[run.device]
    layouts, _ = layouts_for(
        run.workload, run.layout.devices, run.devices_per_host, stages=run.layout.stage > 1
    )
    rows = [
        plan_row(run.workload, layout, profile, run.devices_per_host, run.exposed_axes)
        for layout in layouts
    ]
    return rank(rows)[0]


def published_points() -> list[dict]:
    """Every run's `point` (`--published --json`'s points)."""
    return [point(run) for run in RUNS]


def within_trend_rule(published_drop: float, predicted_drop: float) -> bool:
    """Whether a series' predicted drop (first point's utilization minus its last's) is within
    a third of its published drop."""
    return abs(predicted_drop - published_drop) <= abs(published_drop) / 3


def series(points: list[dict]) -> list[dict]:
    """Each series of `points` (`published_points()`) from its first point to its last: the
    published and predicted utilization at both ends and their drops; `within_rule`: the
    predicted drop within a third of the published one (the tests hold every series to it)."""
    runs = {run.name: run for run in RUNS}
    grouped: dict[str, list[dict]] = {}
    for p in points:
        if runs[p["name"]].series:
            grouped.setdefault(runs[p["name"]].series, []).append(p)
    out = []
    for name, members in grouped.items():
        first, last = members[0], members[-1]
        published_drop = first["published_mfu"] - last["published_mfu"]
        predicted_drop = first["predicted_mfu"] - last["predicted_mfu"]
        out.append(
            {
                "name": name,
                "devices": [runs[p["name"]].layout.devices for p in members],
                "published": [p["published_mfu"] for p in members],
                "predicted": [p["predicted_mfu"] for p in members],
                "published_drop": published_drop,
                "predicted_drop": predicted_drop,
                "within_rule": within_trend_rule(published_drop, predicted_drop),
            }
        )
    return out


def point(run: PublishedRun) -> dict:
    """A run's configuration, the published and predicted utilization, and the planner's best
    mesh for the same model and devices."""
    predicted = predicted_utilization(run)
    best = best_layout(run)
    published_mesh = predicted["prediction"]
    t = run.transformer
    return {
        "name": run.name,
        "source": run.source,
        "quote": run.quote,
        "device": run.device,
        "calibration": run.calibration,
        "configuration": (
            f"{t.layers} layers x {t.width}, {run.layout.devices} devices, data "
            f"{run.layout.data} x fsdp {run.layout.fsdp} x tensor {run.layout.tensor} x "
            f"pipeline {run.layout.stage}, batch {run.global_batch} x {t.seq_len} tokens"
        ),
        "mesh": run.layout.sizes,
        "published_mesh_fits": plan_row(
            run.workload, run.layout, PRESETS[run.device], run.devices_per_host
        )["fits"],
        "metric": {
            "megatron": "FLOPs utilization (with recompute, Megatron's count)",
            "palm": "MFU (PaLM's 6N + 12LHQT)",
            "maxtext": "MFU (MaxText's count)",
        }[run.convention],
        "published_mfu": run.published,
        "predicted_mfu": predicted["predicted_mfu"],
        "predicted_step_s": predicted["predicted_step_s"],
        "relative_error": predicted["predicted_mfu"] / run.published - 1,
        "best": {
            "layout": best["layout"],
            "mesh": best["mesh"],
            "predicted_mfu": predicted["predicted_mfu"]
            * published_mesh.step_s
            / best["predicted_step_s"],
            "gain": published_mesh.step_s / best["predicted_step_s"] - 1,
            "fits": best["fits"],
        },
    }
