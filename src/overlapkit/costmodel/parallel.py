"""How a transformer is split over GPUs (TP, CP, PP, DP, EP, ZeRO) and which overlap each engine uses.

`ParallelConfig` carries every setting that changes what a step computes or sends — the split,
the recomputation, the attention kernel, how pipeline sends travel, the gradient-reduction
dtype, where the DP reduction may hide — so that a published run can be stated, not guessed.
`validate` refuses sizes that don't divide with one line naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..vocabulary import OVERLAP_MODES, TRANSPORTS, ParallelSizes
from . import _validate as v

if TYPE_CHECKING:
    from .model import ModelConfig

MODES = OVERLAP_MODES
"""Overlap settings, with the same meaning in every engine (vocabulary.OVERLAP_MODES)."""
RECOMPUTE = ("none", "selective", "op", "full")
"""none; selective: the attention core (Megatron); op: every other matmul and the memory-bound ops
(torchtitan's per-op selective AC); full: the whole layer's forward."""
ATTENTION = ("flash", "flash2", "unfused")
"""flash: fused attention at the fitted rate (cuDNN / FlashAttention-3-class kernels on Hopper, as
torch 2.11's SDPA on our H200); flash2: FlashAttention-2-class kernels (PyTorch SDPA's flash backend
of 2024), slower on Hopper (Hardware.flash2_slowdown); unfused: scores materialized, softmax and
dropout as separate kernels over b·heads·s² elements (Megatron-LM before 2022)."""
DTYPES = ("bf16", "fp16", "fp8")
GRAD_ACCUMULATION = ("fused", "hook", "autograd", "kept")
"""How each micro-batch's weight gradient joins the step's gradient. fused: inside the wgrad GEMM's
epilogue (Megatron-Core's default gradient_accumulation_fusion), no extra pass; hook: the GEMM
writes a fresh gradient and a backward hook adds it into the reduction buffer, every micro-batch
(Megatron-LM 2021's local DDP, megatron/model/distributed.py `param.main_grad.add_(param.grad)`);
autograd: PyTorch's AccumulateGrad keeps the first micro-batch's gradient and adds every later one
in place into param.grad (torch DDP under no_sync, DeepSpeed's engines); kept: param.grad stays allocated
from step to step (zero_grad(set_to_none=False); overlapkit's DataParallel and torch DDP's
gradient_as_bucket_view keep their buckets' views), so every micro-batch's gradient, the first too, is added
in place."""
WEIGHTS = ("master", "autocast")
"""How parameters meet the GEMMs. master: held in the compute dtype, with fp32 master copies inside the
optimizer (Megatron, DeepSpeed's bf16 engine, Transformer Engine; FSDP2 with param_dtype=bf16); autocast: held
in fp32 under torch.autocast (a plain PyTorch loop, HF Trainer's bf16=True, accelerate's mixed_precision):
every GEMM's weight is cast to the compute dtype in each forward and its gradient cast back to fp32 in
backward, the gradients are fp32, and torch's clip_grad_norm_ scales every gradient, whatever the norm."""
MAX_SIZE = 1 << 24
"""Largest split size or micro-batch accepted: beyond it a number is a typo, not a cluster."""
MAX_GLOBAL_BATCH = 1 << 24
"""Largest global batch accepted, in sequences (16.8 M; Llama 3's largest step took 2048 of 8K tokens):
beyond it a number is a typo, and the predicted step would be centuries long."""


@dataclass(frozen=True)
class Overlap:
    """The overlap setting of each engine (none, bulk, pipelined or auto)."""

    tp: str = "none"
    """TP/SP: bulk hides backward dgrad collectives behind wgrad; pipelined also chunks the
    forward (and backward) all-gather/reduce-scatter into the GEMMs."""
    dp: str = "none"
    """DP gradient buckets reduced during backward (any setting but none)."""
    zero: str = "none"
    """ZeRO parameter gathers prefetched behind earlier layers' compute."""
    pp: str = "none"
    """Pipeline send/recv beside the other micro-batch's compute in 1F1B."""
    ep: str = "none"
    """MoE dispatch/combine chunked against expert GEMMs (pipelined or auto)."""
    cp: str = "none"
    """CP: the next key/value block travels around the ring while the current one is attended."""

    def __post_init__(self) -> None:
        for f in ("tp", "dp", "zero", "pp", "ep", "cp"):
            v.one_of("overlap", f, getattr(self, f), MODES)

    @classmethod
    def all(cls, mode: str) -> "Overlap":
        return cls(mode, mode, mode, mode, mode, mode)


@dataclass(frozen=True)
class ParallelConfig(ParallelSizes):
    """How the model is split over GPUs, and what overlaps.

    The sizes tp, dp, pp, ep and cp are `ParallelSizes`' own fields (declared once, in the vocabulary,
    for the mesh, the demo and this model alike); what follows is what only a prediction needs.
    """

    vpp: int = 1
    """Virtual stages (model chunks) per pipeline rank: interleaved 1F1B."""
    sp: bool = True
    """Sequence parallelism: TP's all-reduces become all-gather + reduce-scatter, which can overlap."""
    micro_batch: int = 1
    """Sequences per micro-batch."""
    global_batch: int = 0
    """Sequences per optimizer step over all replicas; 0 means micro_batch * dp (one micro-batch)."""
    recompute: str = "none"
    """Activation recomputation: one of RECOMPUTE."""
    zero: int = 0
    """ZeRO stage: 1/2 shard optimizer state/gradients (reduce-scatter + parameter all-gather),
    3 also shards parameters (gathered per layer, per micro-batch)."""
    overlap: Overlap = field(default_factory=Overlap)
    """Overlap per engine."""
    tp_transport: str = "p2p"
    """How pipelined TP chunks move: p2p (NCCL send/recv) or symm_mem (copy engines)."""
    dtype: str = "bf16"
    """Data type of GEMMs and activations: bf16, fp16 (same matrix speed; adds the loss-scale
    unscale and inf check over the gradients) or fp8."""
    grad_bytes: int = 2
    """Bytes per gradient element in the DP reduction (2: bf16, 4: fp32, as Megatron does by default)."""
    bucket_mib: float = 25.0
    """DP gradient bucket size, MiB (PyTorch DDP's default)."""
    attention: str = "flash"
    """Attention kernel: one of ATTENTION."""
    pp_scatter_gather: bool = False
    """Pipeline sends split over the TP ranks, each sending 1/tp, re-assembled by an all-gather over
    NVLink (Megatron's scatter-gather optimization, on by default there)."""
    dp_in_drain: bool = False
    """The DP reduction of a stage starts as soon as its last backward is done, inside the pipeline
    drain (Megatron overlap_grad_reduce with PP), instead of after the whole schedule."""
    first_stage_layers: int = 0
    """Layers on the first pipeline stage; 0: an even share (Megatron --decoder-first-pipeline-num-layers)."""
    last_stage_layers: int = 0
    """Layers on the last pipeline stage; 0: an even share (--decoder-last-pipeline-num-layers)."""
    eager: bool = False
    """Memory-bound ops run as one PyTorch kernel per op (no torch.compile, no fused norm/activation
    kernels), and each op pays the host's dispatch cost; False: fused (compiled, or Megatron/TE kernels)."""
    grad_accumulation: str = "fused"
    """How micro-batch gradients accumulate: one of GRAD_ACCUMULATION (an extra memory pass over the
    stage's gradients per micro-batch for hook and autograd; none for fused)."""
    weights: str = "master"
    """How parameters meet the GEMMs: one of WEIGHTS (autocast adds a cast of every GEMM weight per
    micro-batch each way, fp32 gradients and the clipping scale)."""
    moe_chunks: int = 4
    """Token chunks the MoE dispatch/combine are split into when EP overlap is on."""
    zero3_prefetch: int = -1
    """ZeRO-3 / FSDP prefetch depth (layers gathered ahead); -1: chosen by fsdp_prefetch_choice."""
    zero3_wrap: int = 1
    """Layers per ZeRO-3 / FSDP unit: one all-gather and one reduce-scatter per unit."""

    def __post_init__(self) -> None:
        # ParallelSizes' checks are a subset of these, which name the field as the planner's messages do.
        o = "parallel"
        for f in ("tp", "pp", "vpp", "dp", "ep", "cp", "micro_batch", "moe_chunks", "zero3_wrap"):
            v.positive_int(o, f, getattr(self, f))
            if getattr(self, f) > MAX_SIZE:
                raise v.ConfigError(f"{o}.{f}={getattr(self, f)}: must be <= {MAX_SIZE}")
        for f in ("sp", "pp_scatter_gather", "dp_in_drain", "eager"):
            v.boolean(o, f, getattr(self, f))
        if not isinstance(self.overlap, Overlap):
            raise v.ConfigError(f"{o}.overlap={self.overlap!r}: must be an Overlap")
        if self.global_batch == 0:
            object.__setattr__(self, "global_batch", self.micro_batch * self.dp)
        v.positive_int(o, "global_batch", self.global_batch)
        if self.global_batch > MAX_GLOBAL_BATCH:
            raise v.ConfigError(f"{o}.global_batch={self.global_batch}: must be <= {MAX_GLOBAL_BATCH} sequences")
        v.divides(o, "global_batch", self.global_batch, "micro_batch*dp", self.micro_batch * self.dp)
        v.one_of(o, "recompute", self.recompute, RECOMPUTE)
        v.one_of(o, "zero", self.zero, (0, 1, 2, 3))
        v.one_of(o, "tp_transport", self.tp_transport, TRANSPORTS)
        v.one_of(o, "dtype", self.dtype, DTYPES)
        v.one_of(o, "grad_bytes", self.grad_bytes, (2, 4))
        v.one_of(o, "attention", self.attention, ATTENTION)
        v.one_of(o, "grad_accumulation", self.grad_accumulation, GRAD_ACCUMULATION)
        v.one_of(o, "weights", self.weights, WEIGHTS)
        v.finite(o, "bucket_mib", self.bucket_mib)
        if self.bucket_mib > 1 << 20:
            raise v.ConfigError(f"{o}.bucket_mib={self.bucket_mib!r}: must be <= {1 << 20} (1 TiB)")
        for f in ("first_stage_layers", "last_stage_layers"):
            x = getattr(self, f)
            if not isinstance(x, int) or isinstance(x, bool) or x < 0:
                raise v.ConfigError(f"{o}.{f}={x!r}: must be an integer >= 0 (0: an even share)")
            if x and self.pp == 1:
                raise v.ConfigError(f"{o}.{f}={x} needs pp > 1")
        if not isinstance(self.zero3_prefetch, int) or isinstance(self.zero3_prefetch, bool) or self.zero3_prefetch < -1:
            raise v.ConfigError(f"{o}.zero3_prefetch={self.zero3_prefetch!r}: must be -1 (auto) or an integer >= 0")
        if self.vpp > 1 and self.pp == 1:
            raise v.ConfigError(f"parallel.vpp={self.vpp} needs pp > 1 (virtual stages interleave a pipeline)")
        v.divides(o, "dp", self.dp, "ep", self.ep)

    @property
    def sizes(self) -> ParallelSizes:
        """The parallel sizes alone, as the mesh (runtime.groups) lays them out."""
        return ParallelSizes(tp=self.tp, dp=self.dp, pp=self.pp, ep=self.ep, cp=self.cp)

    @property
    def world(self) -> int:
        return self.world_size

    @property
    def micro_batches(self) -> int:
        """Micro-batches per step on each pipeline."""
        return self.global_batch // (self.micro_batch * self.dp)

    def stage_layers(self, num_layers: int) -> list[int]:
        """Layers of each pipeline stage (all its virtual stages), first to last."""
        given = [x for x in (self.first_stage_layers, self.last_stage_layers) if x]
        middle = self.pp - len(given)
        rest = num_layers - sum(given)
        share = rest // middle if middle else 0
        layers = [share] * self.pp
        if self.first_stage_layers:
            layers[0] = self.first_stage_layers
        if self.last_stage_layers:
            layers[-1] = self.last_stage_layers
        return layers


def validate(model: "ModelConfig", par: ParallelConfig, gpus_per_node: int, hardware_name: str = "",
             gpus: int | None = None) -> None:
    """Refuse a split that does not divide or does not fit the hardware; one line per error."""
    o = "parallel"
    v.divides("model", "num_heads", model.num_heads, "tp", par.tp)
    if model.num_kv_heads % par.tp and par.tp % model.num_kv_heads:
        raise v.ConfigError(f"model.num_kv_heads={model.num_kv_heads} and tp={par.tp}: one must divide the other")
    v.divides("model", "ffn_hidden", model.ffn_hidden, "tp", par.tp)
    _stages(model, par)
    if par.cp > 1:  # the load-balanced causal split gives each rank two halves of 2·cp chunks
        v.divides("model", "seq_len", model.seq_len, "2*cp (context parallelism, two chunks per rank)", 2 * par.cp)
    if par.sp:
        v.divides("model", "seq_len", model.seq_len, "cp*tp (sequence parallelism)", par.cp * par.tp)
    if par.vpp > 1 and par.micro_batches % par.pp:
        raise v.ConfigError(f"{o}.global_batch={par.global_batch} gives {par.micro_batches} micro-batches: "
                            f"interleaved 1F1B (vpp={par.vpp}) needs a multiple of pp={par.pp}")
    if par.ep > 1 and model.num_experts == 1:
        raise v.ConfigError(f"{o}.ep={par.ep} needs a mixture-of-experts model (num_experts > 1)")
    if par.ep > 1:
        v.divides("model", "num_experts", model.num_experts, "ep", par.ep)
    where = f" of {hardware_name}" if hardware_name else ""
    if par.tp > gpus_per_node:
        raise v.ConfigError(f"{o}.tp={par.tp} exceeds gpus_per_node={gpus_per_node}{where}: "
                            f"tensor parallelism must stay inside one NVLink node")
    if par.world > gpus_per_node and par.world % gpus_per_node:
        raise v.ConfigError(f"world size tp*cp*pp*dp={par.world} does not fill whole nodes of {gpus_per_node} GPUs{where}")
    if gpus is not None and gpus != par.world:
        raise v.ConfigError(f"gpus={gpus} but tp*cp*pp*dp={par.tp}*{par.cp}*{par.pp}*{par.dp}={par.world}")


def _stages(model: "ModelConfig", par: ParallelConfig) -> None:
    """Layers split over pp·vpp model chunks, evenly or with the first/last stage given (whose own
    chunks may then differ by a layer: Llama 3's 7-layer end stages under interleaving)."""
    given = [x for x in (par.first_stage_layers, par.last_stage_layers) if x]
    if not given:
        v.divides("model", "num_layers", model.num_layers, "pp*vpp", par.pp * par.vpp)
        return
    rest, middle = model.num_layers - sum(given), par.pp - len(given)
    if rest < middle * par.vpp or (middle == 0 and rest):
        raise v.ConfigError(f"model.num_layers={model.num_layers}: first/last stage layers {given} leave {rest} "
                            f"for {middle} other stage(s)")
    if middle:
        v.divides("model", f"num_layers minus first/last stages ({rest})", rest,
                  f"(pp - {len(given)})*vpp", middle * par.vpp)
