"""The distributed runtime: one rank's share of a plan, executed on torch.distributed.

:class:`PipelineRunner` holds the stage modules codegen made and runs its rank's action list
(``2F0``, ``2B0``, ...) in order; stage-to-stage values travel by point-to-point send/recv
(each receive posted a few actions ahead, so the transfer runs while the rank computes),
gradients of the stages a data-parallel group replicates are summed over that group, and
parameters tied across pipeline ranks (an LLM's embedding and output layer) are summed over
the ranks that hold them, as Megatron-LM does. gloo on CPU, NCCL on GPU.

Why an executor of our own and not torch.distributed.pipelining's action-list runtime
(``_PipelineScheduleRuntime``): the plans run the same either way, but a dead or hung rank must
make every other rank exit within the timeout *naming the rank it lost*. We post every receive
ourselves, so each wait has a deadline and knows which peer and which action it waits for;
behind the private runtime a lost peer surfaces as a bare gloo error. Owning the loop also
lets the runtime weight microbatch losses by their label tokens (below) and hand every action
to an ``on_action`` hook (progress, tracing, fault-injection tests).

Loss: each microbatch's loss is weighted by its share of the global batch's label tokens
(``labels[..., 1:] != -100``, the convention of transformers and the zoo), or equally without
``labels``, so the loss and gradients equal eager training on the whole batch whenever the
model's loss is a mean over label tokens. Gradients accumulate into ``.grad`` as eager
``loss.backward()`` does; the caller zeroes them.
"""

from __future__ import annotations

import ctypes
import dataclasses
import datetime
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from vlmcompile.ir.actions import Action, ActionKind
from vlmcompile.ir.errors import PlanError, VlmCompileError
from vlmcompile.ir.microbatch import label_weights, take
from vlmcompile.ir.packed import BatchPlan, PackedBatch, PackedLayout
from vlmcompile.ir.plan import Parallel, Plan
from vlmcompile.runtime.collectives import Deadline, RankLostError, sum_gradients
from vlmcompile.runtime.stage import StageModule, move_stage
from vlmcompile.runtime.transfers import Transfer, transfer_order


class BatchError(VlmCompileError, ValueError):
    """A training batch does not match the shapes the pipeline was compiled for."""


@dataclass(frozen=True, slots=True)
class RuntimeCapabilities:
    """What the runtime can run; planning for ranks it starts itself keeps within these."""

    tensor_parallel: bool
    split_backward: bool
    """Separate input- and weight-gradient actions (I, W: zero-bubble schedules)."""


RUNTIME = RuntimeCapabilities(tensor_parallel=False, split_backward=False)


def runnable_degrees(plan: Plan) -> Parallel:
    """The degrees the plan's ranks are laid out by (its pipeline's), if the runtime can run the
    plan; else a :class:`PlanError` saying why. An encoder group with degrees of its own runs as
    stages replicated over the pipeline's ranks."""
    for name, par in plan.parallel.items():
        if par.tp != 1 and not RUNTIME.tensor_parallel:
            raise PlanError(
                f"the runtime has no tensor parallelism yet; this plan's group {name!r} has TP={par.tp} "
                "(plan with tp=1)"
            )
    if not RUNTIME.split_backward and any(
        a.kind in (ActionKind.I, ActionKind.W) for acts in plan.actions for a in acts
    ):
        raise PlanError(
            "the runtime runs full backward actions (B); this plan splits backwards into I and W "
            "(zero_bubble) - plan with 1f1b, interleaved_1f1b or (a V-shaped placement) v_1f1b"
        )
    return plan.pipeline_parallel


RECEIVE_AHEAD = 2
"""Actions ahead of the running one whose inputs from other ranks are received in the background."""
_HEADER = 1000
"""Tag offset of the shape header a stage sends before its first activations."""
_ORDERED_HEADER = 1024
"""Numbers in the shape header of ordered transfers (fixed: its receive is posted unseen)."""
_DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.complex64,  # Llama4's rotary frequencies (freqs_cis) are read by every decoder layer
    torch.complex128,
]


def keep_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the OS.

    A step allocates and frees the same activations again and again. By default glibc maps
    blocks above a (dynamic) threshold fresh from the OS and gives back a freed heap top, so a
    CPU rank pays page faults for its activations on every step: 17,000-35,000 minor faults
    per step on rank 0 of the demo after the first, under 3,000 with these settings (the
    caching allocator of a GPU keeps its blocks the same way). Returns whether the settings took
    (glibc only; elsewhere nothing changes)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    return all(
        libc.mallopt(option, value) == 1
        for option, value in (
            (m_mmap_threshold, 1 << 30),  # blocks under 1 GiB come from the heap
            (m_trim_threshold, (1 << 31) - 1),  # keep a freed heap top up to 2 GiB
            (m_top_pad, 256 << 20),  # grow the heap 256 MiB at a time
        )
    )


@dataclass(slots=True)
class _StepState:
    """What one step's actions hand each other on this rank."""

    microbatches: list[Mapping[str, Any]]
    """This rank's data-parallel shard, cut into microbatches."""
    weights: Sequence[float]
    """Each microbatch's share of the global batch's label tokens."""
    loss_sum: torch.Tensor
    """This rank's weighted microbatch losses (float64, on the rank's device)."""
    sizes: list[dict[str, int]] | None = None
    """Packed pipelines: each microbatch's size symbols, from which every value a stage sends
    has a known shape before the step (:mod:`vlmcompile.ir.shape_plan`); None: one shape for all."""
    saved: dict[tuple[int, int], tuple[tuple, Any]] = field(default_factory=dict)
    """(stage, microbatch) -> the forward's inputs (leaves) and outputs, until its backward."""
    local_fwd: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """Activations for a next stage on this same rank."""
    local_bwd: dict[tuple[int, int], tuple] = field(default_factory=dict)
    """Gradients for a previous stage on this same rank."""
    sends: list[tuple[Any, str, int]] = field(default_factory=list)
    """Posted sends, waited for at the end of the step."""
    posted: dict[Action, tuple[list[torch.Tensor], list[tuple[Any, str, int]]]] = field(default_factory=dict)
    """Action -> the buffers and receives posted ahead for its input from another rank."""
    outbox: dict[Transfer, tuple[torch.Tensor | None, list[torch.Tensor]]] = field(default_factory=dict)
    """Ordered transfers: values produced, not yet issued (a receive before them is not posted)."""
    inbox: dict[Transfer, tuple[list[torch.Tensor], list[Any]]] = field(default_factory=dict)
    """Ordered transfers: buffers and works of the receives issued."""
    headers: dict[Transfer, tuple[torch.Tensor, list[Any]]] = field(default_factory=dict)
    """Ordered transfers: shape headers whose receive is issued, before their activations'."""
    cursor: dict[int, int] = field(default_factory=dict)
    """Ordered transfers: per peer pipeline rank, how many of the pair's transfers were issued."""


@dataclass(frozen=True, slots=True)
class _Carry:
    """What this rank's run-ahead forwards (``Plan.ahead``) made during a step, for the next."""

    batch: Mapping[str, Any]
    """The global batch they were computed on (the ``next_batch`` that step was given)."""
    outputs: dict[tuple[int, int], tuple]
    """(consuming stage, microbatch) -> the outputs of the forward that ran ahead."""


class PipelineRunner:
    """One rank's part of a compiled pipeline. Build it on every rank (``CompiledPipeline.runner``)
    after ``torch.distributed`` is initialised, or let ``CompiledPipeline.launch`` do both."""

    def __init__(
        self,
        plan,
        stages: tuple[StageModule, ...],
        *,
        batch_shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
        batch_constants: Mapping[str, Any] | None = None,
        sample_rows: Mapping[str, int] | None = None,
        specialized: Mapping[str, torch.Tensor] | None = None,
        timeout_s: float = 60.0,
        device: torch.device | str | None = None,
        autocast_dtype: torch.dtype | None = None,
        transfers: str = "auto",
        state_names: Mapping[str, tuple[str, ...]] | None = None,
        packed: PackedLayout | None = None,
    ):
        if transfers not in ("auto", "tagged", "ordered"):
            raise ValueError(f"transfers={transfers!r}; give 'auto', 'tagged' or 'ordered'")
        plan.validate()  # whatever made the plan: never run one that fails its checks
        self.plan = plan
        self.parallel = runnable_degrees(plan)
        self.stages_all = stages
        self.batch_shapes = dict(batch_shapes)
        self.batch_constants = dict(batch_constants or {})
        """Non-tensor batch values (``return_loss=True``): capture baked them into the graph."""
        self.sample_rows = dict(sample_rows or {k: 1 for k in self.batch_shapes})
        """Rows each sample holds per batch key (:func:`vlmcompile.ir.microbatch.rows_per_sample`)."""
        self.specialized = dict(specialized or {})
        """Batch key -> the values of one microbatch the stage graphs are specialised on."""
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.on_action: Callable[[int, Action], None] | None = None
        self.device = torch.device(device) if device is not None else None
        """Where this rank's stages run (None: CUDA device ``torch.cuda.current_device()`` under
        NCCL, else the CPU); set by :meth:`setup`."""
        self.autocast_dtype = autocast_dtype
        """Mixed precision: the stages' forwards run under ``torch.autocast`` in this dtype
        (bf16), while parameters, their gradients and the gradient reduction stay fp32."""
        self.transfers = transfers
        """How stage-to-stage values meet their receives: ``tagged`` (gloo: by tag, each receive
        posted a few actions ahead), ``ordered`` (NCCL: every transfer between two ranks issued in
        one order both follow, :mod:`vlmcompile.runtime.transfers`, in batched isend/irecv
        groups); ``auto``: tagged on gloo, ordered otherwise."""
        self.packed = packed
        """The layout of a pipeline captured once for packed microbatches; its steps take a
        :class:`PackedBatch`."""
        self.per_batch_schedules = False
        """Each step runs the schedule of the batch global rank 0 holds (``PackedBatch.schedule``,
        broadcast by rank 0 at the step's start; none: the plan's actions). Every rank must agree."""
        self._carry: _Carry | None = None
        self.run_ahead_recomputed = 0
        """Steps whose run-ahead outputs this rank computed at their start (the first step, one
        after a resume, or one whose batch was not the ``next_batch`` promised the step before)."""
        self.state_names = dict(state_names) if state_names is not None else None
        """Original name -> every name the original model's ``state_dict`` gives that tensor (tied
        parameters have several; non-persistent buffers none); None: parameters under their
        captured names only."""
        self._ready = False

    # ---- set-up --------------------------------------------------------------------------
    def setup(self) -> None:
        """Pick this rank's stages and make the process groups (every rank must call it)."""
        if self._ready:
            return
        if not dist.is_initialized():
            raise RuntimeError(
                "torch.distributed is not initialised: start the ranks with torchrun, or use "
                "CompiledPipeline.launch(nprocs=N) to start N local ranks"
            )
        world = dist.get_world_size()
        if world != self.parallel.world_size:
            raise PlanError(
                f"the plan runs on {self.parallel.world_size} ranks (PP={self.parallel.pp} x DP={self.parallel.dp}), "
                f"but torch.distributed has {world}; start {self.parallel.world_size} ranks or plan for {world}"
            )
        backend = dist.get_backend()
        if self.device is None:
            cuda = backend == "nccl"
            self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise PlanError(f"device {self.device} was asked for, but this machine has no CUDA device")
        if self.device.type != "cpu" and backend == "gloo":
            raise PlanError(
                f"stages on {self.device} need the NCCL backend (gloo sends CPU tensors only); initialise "
                "torch.distributed with backend='nccl', or run on the CPU"
            )
        if backend == "gloo":
            keep_freed_memory()
        if backend != "gloo" and self.transfers == "tagged":
            raise PlanError(f"transfers='tagged' needs gloo: {backend} ignores tags; use 'ordered' or 'auto'")
        self.ordered = self.transfers == "ordered" or (self.transfers == "auto" and backend != "gloo")
        # NCCL's watchdog times every operation from when it was issued, and tears the process
        # down at the group's timeout: give it room past ours, so our wait names the lost peer.
        self._group_timeout = (
            self.timeout if backend == "gloo" else datetime.timedelta(seconds=2 * self.timeout_s + 30)
        )
        self.rank = dist.get_rank()
        self.pp_rank, self.dp_rank, _ = self.parallel.coords(self.rank)
        self.rank_of_action = self.plan.rank_of_action()
        self.stages = {s.index: self.stages_all[s.index] for s in self.plan.stages_on(self.pp_rank)}
        self._trains_before = self._stages_after_trainable()
        self._forward_only = self._check_forward_only()
        self._check_run_ahead()
        if self.device.type != "cpu":
            for stage in self.stages.values():
                move_stage(stage, self.device)
        self.actions = self.plan.actions[self.pp_rank]
        self._step_plan = self.plan
        """The plan whose actions the steps run now (:meth:`use_schedule`)."""
        self._channels = transfer_order(self.plan).get(self.pp_rank, {}) if self.ordered else {}
        """Peer pipeline rank -> the transfers between us in the order both issue them (ordered)."""
        t = self.parallel
        self.dp_group = None
        for pp_rank in range(t.pp):  # every rank creates every group, in the same order
            ranks = [t.global_rank(pp_rank, d) for d in range(t.dp)]
            group = dist.new_group(ranks, timeout=self._group_timeout) if t.dp > 1 else None
            if pp_rank == self.pp_rank:
                self.dp_group, self.dp_ranks = group, ranks
        self.tied = self._tied_groups()
        self._pair_groups = self._make_pair_groups() if self.ordered else {}
        self._meta: dict[tuple[int, int, int], list[tuple[tuple[int, ...], torch.dtype, bool]]] = {}
        """Per (sending stage, sending pipeline rank, receiving pipeline rank): (shape, dtype, is a
        Python number) of each value sent (a replicated stage sends to, and receives from, several
        ranks, and may do both with one peer)."""
        self._flat: dict[int, torch.Tensor] = {}
        """Per gradient reduction (by its group's id): its flat buffer."""
        if backend == "nccl":
            # NCCL leaves batched p2p undefined when it is a group's first operation and not every
            # member takes part: one collective over all ranks first.
            self._wait(dist.barrier(async_op=True), "the barrier that opens NCCL's communicator")
        self._ready = True

    def _stages_after_trainable(self) -> list[bool]:
        """Per stage: whether a stage before it holds a trainable parameter, so its inputs need
        gradients (stage k's inputs come from stage k - 1, which carries everything earlier)."""
        out, seen = [], False
        for module in self.stages_all:
            out.append(seen)
            seen = seen or any(p.requires_grad for p in module.parameters())
        return out

    def _check_forward_only(self) -> frozenset[int]:
        """The plan's stages with no backward actions, checked against the parameters: exactly
        those no gradient reaches (nothing trainable in them or before them)."""
        without = self.plan.forward_only_stages()
        for s, module in enumerate(self.stages_all):
            reached = self._trains_before[s] or any(p.requires_grad for p in module.parameters())
            if reached == (s in without):
                raise PlanError(
                    f"stage {s} has {'no ' if reached else ''}backward actions, but "
                    + (
                        "its parameters or those of a stage before it train"
                        if reached
                        else "no gradient reaches it (its parameters and every earlier stage's are frozen)"
                    )
                    + ": plan again for the model's requires_grad flags as they are now"
                )
        return without

    def _check_run_ahead(self) -> None:
        """The runtime runs a plan's run-ahead forwards on batches of one shape, each chain of
        them on one rank (their outputs stay there until the next step starts)."""
        if not self.plan.ahead:
            return
        if self.packed is not None:
            raise PlanError(
                "this plan runs encoder forwards one batch ahead, which the runtime does for batches of one "
                "shape only; plan packed pipelines without run-ahead (run_ahead=0)"
            )
        for a in sorted(a for a in self.plan.ahead if a.stage > 0):
            before = Action(a.stage - 1, ActionKind.F, a.microbatch)
            if self.rank_of_action[a] != self.rank_of_action[before]:
                raise PlanError(
                    f"run-ahead forward {a} runs on pipeline rank {self.rank_of_action[a]}, its input {before} on "
                    f"{self.rank_of_action[before]}; the runtime keeps a chain of run-ahead forwards on one rank - "
                    "plan the encoder's stages on one rank each, or without run-ahead"
                )

    def _tied_groups(self) -> list[tuple[Any, list[torch.nn.Parameter]]]:
        """Parameters held on several pipeline ranks, one group per set of ranks: tied across
        stages (an LLM's embedding and output layer) or in a stage replicated over ranks (an
        encoder data-parallel inside the pipeline). Either way each holder's gradient is a part of
        the whole, and the parts are summed."""
        holders = self._holders = {}
        by_id: dict[int, dict[int, torch.nn.Parameter]] = {}
        for s in self.plan.stages:
            for p in self.stages_all[s.index].parameters():
                holders.setdefault(id(p), set()).update(s.ranks)
                for r in s.ranks:
                    by_id.setdefault(id(p), {})[r] = p
        out = []
        t = self.parallel
        sets = sorted({tuple(sorted(r)) for r in holders.values() if len(r) > 1})
        for pp_ranks in sets:
            for d in range(t.dp):
                ranks = [t.global_rank(r, d) for r in pp_ranks]
                group = dist.new_group(ranks, timeout=self._group_timeout)
                if self.pp_rank in pp_ranks and d == self.dp_rank:
                    params = [
                        by_id[i][self.pp_rank] for i, r in holders.items() if tuple(sorted(r)) == pp_ranks
                    ]
                    out.append((group, params))
        return out

    def _make_pair_groups(self) -> dict[int, Any]:
        """A process group per pair of pipeline ranks that exchange values (per data-parallel
        replica): NCCL puts the batched p2p of one communicator on one stream, so a receive
        posted ahead from one peer would hold up a send to another; a communicator per pair
        keeps each pair's stream to the pair's own order (:mod:`vlmcompile.runtime.transfers`)."""
        t = self.parallel
        pairs = sorted(
            {tuple(sorted((r, peer))) for r, peers in transfer_order(self.plan).items() for peer in peers}
        )
        out = {}
        for d in range(t.dp):  # every rank creates every group, in the same order
            for a, b in pairs:
                group = dist.new_group(
                    [t.global_rank(a, d), t.global_rank(b, d)], timeout=self._group_timeout
                )
                if d == self.dp_rank and self.pp_rank in (a, b):
                    out[b if a == self.pp_rank else a] = group
        return out

    # ---- what the user's optimizer sees ----------------------------------------------------
    def parameter_owners(self) -> dict[int, bool]:
        """id(parameter) -> whether this rank counts it in whole-model sums (a gradient norm):
        a parameter held on several pipeline ranks counts on the lowest."""
        self.setup()
        return {id(p): min(self._holders[id(p)]) == self.pp_rank for p in self.parameters()}

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, frozen ones (``requires_grad=False``) included."""
        self.setup()
        seen, out = set(), []
        for stage in self.stages.values():
            for p in stage.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters that train (what an optimizer is built over): a frozen one gets
        no gradient, as in eager, so it has no optimizer state, norm or reduction either."""
        return [p for p in self.parameters() if p.requires_grad]

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters under the original model's names."""
        self.setup()
        out = {}
        for stage in self.stages.values():
            own = dict(stage.named_parameters())
            for name, orig in stage.original_names().items():
                if name in own:
                    out[orig] = own[name]
        return out

    def named_state(self) -> dict[str, torch.Tensor]:
        """This rank's share of the original model's ``state_dict``: its parameters and persistent
        buffers under every name the original gives them (what a checkpoint holds)."""
        self.setup()
        out: dict[str, torch.Tensor] = {}
        for stage in self.stages.values():
            own = {**dict(stage.named_parameters()), **dict(stage.named_buffers())}
            for name, orig in stage.original_names().items():
                if name not in own:
                    continue
                if self.state_names is None:
                    if isinstance(own[name], torch.nn.Parameter):
                        out[orig] = own[name]
                    continue
                for alias in self.state_names.get(orig, ()):
                    out[alias] = own[name]
        return out

    # ---- one training step -----------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any] | PackedBatch) -> None:
        if self.packed is not None or isinstance(batch, PackedBatch):
            self._packed_sizes(batch, range(len(getattr(batch, "microbatches", ()))))
            return
        for key, (shape, dtype) in self.batch_shapes.items():
            if key not in batch:
                raise BatchError(
                    f"the batch lacks {key!r}; the pipeline was compiled for {sorted(self.batch_shapes)}"
                )
            value = batch[key]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != shape or value.dtype != dtype:
                got = (
                    f"{list(value.shape)} {value.dtype}"
                    if isinstance(value, torch.Tensor)
                    else type(value).__name__
                )
                raise BatchError(
                    f"batch[{key!r}] is {got}; the pipeline expects {list(shape)} {dtype} (global batch "
                    f"{self.plan.global_batch} = DP x "
                    "microbatches x microbatch size; other dims as in the compiled sample batch)"
                )
        for key, expected in self.batch_constants.items():
            got = batch.get(key, "missing")
            if got is not expected and got != expected:
                raise BatchError(
                    f"batch[{key!r}] is {got!r}; the pipeline was compiled with {expected!r}, and capture "
                    "fixes non-tensor values in the graph: pass the same value, or compile again with this one"
                )
        extra = sorted(set(batch) - set(self.batch_shapes) - set(self.batch_constants))
        if extra:
            raise BatchError(f"the batch has keys {extra} the compiled sample batch did not have")
        if self.specialized:
            mbs = self.plan.microbatch_size
            for i in range(self.parallel.dp * self.plan.num_microbatches):
                self._check_specialized(take(batch, i * mbs, mbs, self.sample_rows), i)

    def step(
        self, batch: Mapping[str, Any] | PackedBatch, next_batch: Mapping[str, Any] | None = None
    ) -> torch.Tensor:
        """Run this rank's actions on ``batch`` (the global batch, or a packed pipeline's
        :class:`PackedBatch`; every rank gets the same one) and return the global loss (the same
        on every rank).

        ``next_batch``: the batch the next step will take, for a plan whose forwards run one batch
        ahead (``Plan.ahead``: a frozen encoder's forwards in this step's bubbles). Without it they
        run at the next step's start instead; with it, it must not change before that step (a
        different batch there is noticed, and its forwards run again)."""
        if self.packed is not None or isinstance(batch, PackedBatch):
            state = self._packed_state(batch)
            if self.device.type != "cpu":
                state.microbatches = [_to_device(mb, self.device) for mb in state.microbatches]
        else:
            self.check_batch(batch)
            self.setup()
            m = self.plan.num_microbatches
            weights = label_weights(batch, self.parallel.dp * m)
            state = _StepState(
                microbatches=self._microbatches(batch),
                weights=weights[self.dp_rank * m : (self.dp_rank + 1) * m],
                loss_sum=torch.zeros((), dtype=torch.float64, device=self.device),
            )
        if self.per_batch_schedules:
            self.use_schedule(self._agreed_schedule(batch))
        ahead = None
        if self.plan.ahead:
            self._start_with_carried(batch, state)
            if next_batch is not None:
                self.check_batch(next_batch)
                ahead = self._ahead_state(next_batch)
        self._state = state  # what the on_action hook may look at (tests: the receives posted ahead)
        params = self.parameters()
        stash = [p.grad for p in params]
        for p in params:
            p.grad = None
        for index, action in enumerate(self.actions):
            self._post_receives_ahead(index, state)
            if self.on_action is not None:
                self.on_action(self.rank, action)
            if action in self.plan.ahead:
                if ahead is not None:  # without the next batch, the next step makes them
                    self._forward_ahead(action, ahead)
            elif action.kind is ActionKind.F:
                self._forward(action, state)
            elif action.kind is ActionKind.B:
                self._backward(action, state)
            else:  # runnable_degrees rejects I/W plans
                raise AssertionError(action)
        if ahead is not None:
            self._carry = _Carry(next_batch, ahead.local_fwd)
        for work, what, peer in state.sends:
            self._wait(work, what, peer)
        self._reduce_gradients(params)
        if isinstance(batch, PackedBatch) and not batch.images:
            drop_unused_gradients(params)
        for p, old in zip(params, stash):
            if old is not None:
                p.grad = old if p.grad is None else p.grad + old
        loss = state.loss_sum.clone()
        self._wait(dist.all_reduce(loss, async_op=True), "the loss all-reduce")
        return loss.float()

    def _microbatches(self, batch: Mapping[str, Any]) -> list[dict[str, Any]]:
        """This rank's data-parallel shard of a global batch, cut into microbatches (on its device)."""
        m, mbs = self.plan.num_microbatches, self.plan.microbatch_size
        shard = take(batch, self.dp_rank * m * mbs, m * mbs, self.sample_rows)
        microbatches = [take(shard, i * mbs, mbs, self.sample_rows) for i in range(m)]
        if self.device.type != "cpu":
            microbatches = [_to_device(mb, self.device) for mb in microbatches]
        return microbatches

    # ---- forwards one batch ahead (Plan.ahead) ----------------------------------------------
    def drop_carried(self) -> None:
        """Forget the outputs made ahead for the next step (its step makes them again): call it
        when parameters change outside a step, as loading a checkpoint does."""
        self._carry = None

    def _ahead_state(self, batch: Mapping[str, Any]) -> _StepState:
        """The state run-ahead forwards on ``batch`` work in (no loss, no gradients)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        return _StepState(microbatches=self._microbatches(batch), weights=(), loss_sum=zero)

    def _forward_ahead(self, action: Action, ahead: _StepState) -> None:
        """A forward of a stage no gradient reaches on the next batch's microbatch: its output
        stays on this rank (for the next run-ahead stage, or for the next step)."""
        s, i = action.stage, action.microbatch
        received = ahead.local_fwd.pop((s, i)) if s > 0 else ()
        _, out = self._run_stage(s, received, ahead.microbatches[i])
        ahead.local_fwd[(s + 1, i)] = out

    def _start_with_carried(self, batch: Mapping[str, Any], state: _StepState) -> None:
        """Hand this step the outputs the step before made ahead for it (computed now when there
        are none for this batch), as the step starts."""
        mine = [a for a in sorted(self.plan.carried()) if self.rank_of_action[a] == self.pp_rank]
        carry, self._carry = self._carry, None
        if not mine:
            return
        if carry is not None and (carry.batch is batch or _same_batch(carry.batch, batch)):
            outputs = carry.outputs
        else:  # the first step, a resume, or not the batch promised: make them now
            self.run_ahead_recomputed += 1
            prologue = self._ahead_state(batch)
            for a in self.actions:
                if a in self.plan.ahead:
                    self._forward_ahead(a, prologue)
            outputs = prologue.local_fwd
        for a in mine:
            s, i = a.stage, a.microbatch
            out = outputs.pop((s + 1, i))
            if self._rank_running(s + 1, ActionKind.F, i) == self.pp_rank:
                state.local_fwd[(s + 1, i)] = out
            else:
                state.sends += self._send_activations(s, i, out, state)

    def _agreed_schedule(self, batch: Any) -> BatchPlan | None:
        """Global rank 0's schedule for this step, on every rank."""
        sent = [getattr(batch, "schedule", None) if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(sent, src=0)
        except RuntimeError as err:
            raise self._lost("the step's schedule from rank 0", err, 0) from err
        return sent[0]

    def use_schedule(self, schedule: BatchPlan | None) -> None:
        """Run ``schedule``'s actions from the next step on (None: the plan's). They are checked
        as a plan's are (every action once, no deadlock) before any runs."""
        self.setup()
        if schedule is not None and self.plan.ahead:
            raise PlanError(
                "this plan runs encoder forwards one batch ahead, and per-batch schedules do not keep them; "
                "plan without run-ahead (run_ahead=0) to re-plan every batch"
            )
        if schedule is None:
            actions = self.plan.actions
        elif len(schedule.actions) != self.parallel.dp:
            raise PlanError(
                f"the batch's schedule is for {len(schedule.actions)} data-parallel replicas; the plan has "
                f"{self.parallel.dp}"
            )
        else:
            actions = schedule.actions[self.dp_rank]
        if tuple(actions[self.pp_rank]) == tuple(self.actions) and actions == self._step_plan.actions:
            return
        plan = dataclasses.replace(self.plan, actions=tuple(tuple(a) for a in actions), kernel_level={})
        plan.validate()
        channels = transfer_order(plan).get(self.pp_rank, {}) if self.ordered else {}
        if set(channels) - set(self._pair_groups):
            raise PlanError(
                f"the batch's schedule has pipeline rank {self.pp_rank} exchange values with pipeline ranks "
                f"{sorted(set(channels) - set(self._pair_groups))}, which the plan's never do (ordered "
                "transfers open a communicator per pair at set-up); re-plan within the plan's pairs"
            )
        self._step_plan, self.actions, self._channels = plan, plan.actions[self.pp_rank], channels
        self.rank_of_action = plan.rank_of_action()

    def _packed_sizes(self, batch: Any, indices: Sequence[int]) -> list[dict[str, int]]:
        """The size symbols of the packed microbatches ``indices`` of ``batch``, after checking
        it is a :class:`PackedBatch` of this pipeline's microbatches."""
        if self.packed is None or not isinstance(batch, PackedBatch):
            compiled = "packed microbatches" if self.packed is not None else "one batch shape"
            raise BatchError(
                f"the step got a {type(batch).__name__}; this pipeline was compiled for {compiled}: "
                + (
                    "give a PackedBatch (CompiledPipeline.step packs a list of samples)"
                    if self.packed
                    else "give a dict"
                )
            )
        parallel = runnable_degrees(self.plan)
        expected = parallel.dp * self.plan.num_microbatches
        if len(batch.microbatches) != expected:
            raise BatchError(
                f"the packed batch holds {len(batch.microbatches)} microbatches; the plan runs DP {parallel.dp} x "
                f"{self.plan.num_microbatches} microbatches = {expected}"
            )
        sizes = []
        for i in indices:
            microbatch = batch.microbatches[i]
            missing = sorted(set(self.packed.input_sizes.inputs) - set(microbatch))
            if missing:
                raise BatchError(f"packed microbatch {i} lacks {missing}")
            try:
                sizes.append(self.packed.input_sizes.bind(microbatch))
            except PlanError as err:
                raise BatchError(f"packed microbatch {i}: {err}") from None
        return sizes

    def _packed_state(self, batch: Any) -> _StepState:
        """This rank's microbatches of a :class:`PackedBatch`, each with its size symbols; every
        microbatch's loss is already its share of the step's (weight 1)."""
        self.setup()
        m = self.plan.num_microbatches
        mine = range(self.dp_rank * m, (self.dp_rank + 1) * m)
        sizes = self._packed_sizes(batch, mine)
        return _StepState(
            microbatches=[batch.microbatches[i] for i in mine],
            weights=[1.0] * m,
            loss_sum=torch.zeros((), dtype=torch.float64, device=self.device),
            sizes=sizes,
        )

    def _planned_shapes(self, stage: int, microbatch: int, state: _StepState) -> list[tuple[int, ...]] | None:
        """The shapes of what ``stage`` sends for ``microbatch``, known before the step (packed
        pipelines), or None."""
        if state.sizes is None:
            return None
        return [f.evaluate(state.sizes[microbatch]) for f in self.stages_all[stage].send_shapes]

    def _activation_buffers(self, stage: int, microbatch: int, meta, state: _StepState) -> list[torch.Tensor]:
        """Receive buffers for ``stage``'s activations of ``microbatch``: dtypes from the stage's
        shape header, shapes from the shape plan where there is one."""
        planned = self._planned_shapes(stage, microbatch, state)
        shapes = planned if planned is not None else [shape for shape, _, _ in meta]
        return [
            torch.empty(shape, dtype=dtype, device=self.device) for shape, (_, dtype, _) in zip(shapes, meta)
        ]

    def _forward(self, action: Action, state: _StepState) -> None:
        s, i = action.stage, action.microbatch
        if s == 0:
            received: tuple = ()
        elif self._rank_running(s - 1, ActionKind.F, i) == self.pp_rank:
            received = state.local_fwd.pop((s, i))
        elif self.ordered:
            sender = self._rank_running(s - 1, ActionKind.F, i)
            buffers = self._receive(Transfer(ActionKind.F, s - 1, i, sender, self.pp_rank), state)
            meta = self._meta[(s - 1, sender, self.pp_rank)]
            received = tuple(b.item() if flag else b for b, (_, _, flag) in zip(buffers, meta))
        else:
            received = self._recv_activations(s, i, state)
        leaves, out = self._run_stage(s, received, state.microbatches[i])
        if s < self.plan.num_stages - 1:
            if s not in self._forward_only:  # no backward will read it
                state.saved[(s, i)] = (leaves, out)
            if self._rank_running(s + 1, ActionKind.F, i) == self.pp_rank:
                state.local_fwd[(s + 1, i)] = out
            else:
                state.sends += self._send_activations(s, i, out, state)
            return
        weight = state.weights[i]
        if weight == 0:
            # No label tokens: the batch's loss does not see this microbatch, and its own mean
            # over no tokens is NaN (0/0), which a zero weight cannot cancel.
            state.saved[(s, i)] = (leaves, None)
            return
        scaled = out * weight
        state.loss_sum += scaled.detach().double()
        state.saved[(s, i)] = (leaves, scaled)

    def _run_stage(self, s: int, received: tuple, microbatch: Mapping[str, Any]) -> tuple[tuple, Any]:
        """Stage ``s``'s forward on its inputs from the stage before: (its input leaves, its outputs)."""
        # Below a stage whose inputs come from frozen stages only, no gradient flows: eager's
        # autograd never enters a frozen encoder, so neither does ours.
        needs_grad = self._trains_before[s]
        leaves = tuple(
            x.detach().requires_grad_(needs_grad and x.is_floating_point())
            if isinstance(x, torch.Tensor)
            else x
            for x in received
        )
        if self.autocast_dtype is None:
            return leaves, self.stages[s](leaves, microbatch)
        with torch.autocast(self.device.type, dtype=self.autocast_dtype):
            return leaves, self.stages[s](leaves, microbatch)

    def _backward(self, action: Action, state: _StepState) -> None:
        s, i = action.stage, action.microbatch
        if s == self.plan.num_stages - 1:
            leaves, out = state.saved.pop((s, i))
            if out is not None and out.requires_grad:
                out.backward()
        else:
            if self._rank_running(s + 1, ActionKind.B, i) == self.pp_rank:
                grads = state.local_bwd.pop((s, i))
            else:
                grads = self._recv_grads(s, i, state)  # its buffers take the saved output's shapes
            leaves, out = state.saved.pop((s, i))
            pairs = [(o, g) for o, g in zip(_floats(out), grads) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if s == 0 or s - 1 in self._forward_only:
            return  # no gradient goes back to a stage with nothing to train in or before it
        input_grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in _floats(leaves))
        prev = self._rank_running(s - 1, ActionKind.B, i)
        if prev == self.pp_rank:
            state.local_bwd[(s - 1, i)] = input_grads
        elif self.ordered:
            self._offer(Transfer(ActionKind.B, s, i, self.pp_rank, prev), list(input_grads), state, None)
        else:
            state.sends += self._send(input_grads, prev, s, "B", i, f"{action}'s input gradients")

    def _check_specialized(self, microbatch: Mapping[str, Any], index: int) -> None:
        for key, expected in self.specialized.items():
            got = microbatch[key]
            if got.shape != expected.shape or not torch.equal(got, expected.to(got.device)):
                raise BatchError(
                    f"microbatch {index}'s {key!r} {_first_difference(got, expected)}: the model's shapes depend on "
                    "these values, so every microbatch must bring the ones the pipeline was captured for (same "
                    "image sizes and token layout), or compile again with such a batch"
                )

    # ---- communication ---------------------------------------------------------------------
    def _rank_running(self, stage: int, kind: ActionKind, microbatch: int) -> int:
        """The pipeline rank that runs an action (a replicated stage runs each microbatch on one
        of its holders; ``Plan.validate`` checked that every action runs somewhere)."""
        return self.rank_of_action[Action(stage, kind, microbatch)]

    def _peer(self, pp_rank: int) -> int:
        return self.parallel.global_rank(pp_rank, self.dp_rank)

    def _tag(self, stage: int, kind: str, microbatch: int, k: int) -> int:
        return ((stage * 2 + (kind == "B")) * self.plan.num_microbatches + microbatch) * 1024 + k

    def _send(
        self, tensors, pp_rank: int, stage: int, kind: str, microbatch: int, what: str, first: int = 0
    ) -> list:
        peer = self._peer(pp_rank)
        works = []
        for k, x in enumerate(tensors):
            try:
                work = dist.isend(
                    _wire(x.detach().contiguous()), peer, tag=self._tag(stage, kind, microbatch, first + k)
                )
            except RuntimeError as err:
                raise self._lost(f"the connection failed sending {what} to rank {peer}", err, peer) from None
            works.append((work, f"{what} to rank {peer}", peer))
        return works

    def _send_activations(self, s: int, i: int, out: tuple, state: _StepState) -> list:
        if len(out) >= _HEADER:
            raise PlanError(
                f"stage {s} would send {len(out)} values to the next rank; the runtime sends fewer than "
                f"{_HEADER} - cut the pipeline elsewhere"
            )
        scalar = [isinstance(x, (bool, int, float)) for x in out]
        for k, x in enumerate(out):
            if not isinstance(x, torch.Tensor) and not scalar[k]:
                raise PlanError(
                    f"stage {s} would send {self.stages[s].send[k]!r}, a {type(x).__name__}, to the next rank; "
                    "only tensors and Python numbers cross ranks - cut the pipeline elsewhere"
                )
            if isinstance(x, torch.Tensor) and (
                x.dtype not in _DTYPES or (x.is_complex() and x.requires_grad)
            ):
                raise PlanError(
                    f"stage {s} would send {self.stages[s].send[k]!r}, a {x.dtype} tensor"
                    + (" that needs a gradient" if x.dtype in _DTYPES else "")
                    + ", to the next rank, which the runtime cannot do; cut the pipeline elsewhere"
                )
        # Python numbers (sizes computed from shapes) travel as 0-d tensors.
        out = tuple(torch.tensor(x, device=self.device) if flag else x for x, flag in zip(out, scalar))
        planned = self._planned_shapes(s, i, state)
        if planned is not None and planned != [tuple(x.shape) for x in out]:
            raise PlanError(
                f"stage {s} made values of shapes {[list(x.shape) for x in out]} for microbatch {i}, where the shape "
                f"plan says {[list(p) for p in planned]}: the capture does not hold for this microbatch; report this"
            )
        works = []
        peer_pp = self._rank_running(s + 1, ActionKind.F, i)
        header = None
        if (s, self.pp_rank, peer_pp) not in self._meta:
            self._meta[(s, self.pp_rank, peer_pp)] = [
                (tuple(x.shape), x.dtype, flag) for x, flag in zip(out, scalar)
            ]
            values = [len(out)] + [
                v
                for x, flag in zip(out, scalar)
                for v in (int(flag), _DTYPES.index(x.dtype), x.dim(), *x.shape)
            ]
            if self.ordered:  # one fixed size: the receive is posted before the shapes are known
                if len(values) > _ORDERED_HEADER:
                    raise PlanError(
                        f"stage {s} sends {len(out)} values whose shape header takes {len(values)} numbers, more than "
                        f"{_ORDERED_HEADER}; cut the pipeline where fewer values cross"
                    )
                values += [0] * (_ORDERED_HEADER - len(values))
            header = torch.tensor(values, dtype=torch.int64, device=self.device)
        if self.ordered:
            self._offer(Transfer(ActionKind.F, s, i, self.pp_rank, peer_pp), list(out), state, header)
            return []
        if header is not None:
            size = torch.tensor([header.numel()], dtype=torch.int64, device=self.device)
            # Tagged as microbatch 0 whichever microbatch goes first: the receiving rank may run
            # its microbatches in another order.
            works += self._send((size, header), peer_pp, s, "F", 0, f"stage {s}'s activation shapes", _HEADER)
        return works + self._send(out, peer_pp, s, "F", i, f"{Action(s, ActionKind.F, i)}'s activations")

    def _post(
        self, buffers, pp_rank: int, stage: int, kind: str, microbatch: int, what: str, first: int = 0
    ) -> list[tuple[Any, str, int]]:
        peer = self._peer(pp_rank)
        works = []
        for k, buf in enumerate(buffers):
            try:
                work = dist.irecv(_wire(buf), peer, tag=self._tag(stage, kind, microbatch, first + k))
            except RuntimeError as err:
                raise self._lost(
                    f"the connection failed receiving {what} from rank {peer}", err, peer
                ) from None
            works.append((work, f"{what} from rank {peer}", peer))
        return works

    def _recv(
        self, buffers, pp_rank: int, stage: int, kind: str, microbatch: int, what: str, first: int = 0
    ) -> None:
        for work, described, peer in self._post(buffers, pp_rank, stage, kind, microbatch, what, first):
            self._wait(work, described, peer)

    def _post_receives_ahead(self, index: int, state: _StepState) -> None:
        """Post the receives of the running action and the next :data:`RECEIVE_AHEAD` ones.

        gloo moves a message only once its receive is posted (the sender waits for the
        receiver's ready notice), and its own thread then moves it while this rank computes. A
        receive posted only when its action starts costs the whole transfer there, plus the wait
        for a sender that is busy computing to serve it: 3-14 ms for the demo's 0.5 MB
        activations on this 2-core machine, against 0.14 ms unloaded."""
        if self.ordered:
            for peer_pp in self._channels:
                self._advance(peer_pp, state, until=None)
            return
        for action in self.actions[index : index + 1 + RECEIVE_AHEAD]:
            if action not in state.posted:
                posted = self._post_input(action, state)
                if posted is not None:
                    state.posted[action] = posted

    def _post_input(self, action: Action, state: _StepState):
        """Buffers and posted receives for ``action``'s input from another rank; None if it takes
        none, or its shapes are not known yet (a stage's first activations bring a shape header;
        a backward's gradients take its forward's output shapes)."""
        s, i = action.stage, action.microbatch
        if action.kind is ActionKind.F:
            if s == 0:
                return None
            sender = self._rank_running(s - 1, ActionKind.F, i)
            meta = self._meta.get((s - 1, sender, self.pp_rank))
            if sender == self.pp_rank or meta is None:
                return None
            buffers = self._activation_buffers(s - 1, i, meta, state)
            what = f"{Action(s - 1, ActionKind.F, i)}'s activations"
            return buffers, self._post(buffers, sender, s - 1, "F", i, what)
        if s == self.plan.num_stages - 1 or (s, i) not in state.saved:
            return None
        sender = self._rank_running(s + 1, ActionKind.B, i)
        if sender == self.pp_rank:
            return None
        buffers = [
            torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in _floats(state.saved[(s, i)][1])
        ]
        what = f"{Action(s + 1, ActionKind.B, i)}'s input gradients"
        return buffers, self._post(buffers, sender, s + 1, "B", i, what)

    def _take_input(self, action: Action, state: _StepState) -> list[torch.Tensor]:
        """Wait for ``action``'s input from another rank (posting its receives if not done yet)."""
        if action not in state.posted:
            posted = self._post_input(action, state)
            assert posted is not None, action  # the callers fetched the shape header first
            state.posted[action] = posted
        buffers, works = state.posted.pop(action)
        for work, what, peer in works:
            self._wait(work, what, peer)
        return buffers

    def _recv_activations(self, s: int, i: int, state: _StepState) -> tuple:
        prev = s - 1
        sender = self._rank_running(prev, ActionKind.F, i)
        if (prev, sender, self.pp_rank) not in self._meta:
            size = torch.zeros(1, dtype=torch.int64, device=self.device)
            what = f"stage {prev}'s activation shapes"
            self._recv((size,), sender, prev, "F", 0, what, _HEADER)
            header = torch.zeros(int(size), dtype=torch.int64, device=self.device)
            self._recv((header,), sender, prev, "F", 0, what, _HEADER + 1)
            self._meta[(prev, sender, self.pp_rank)] = _parse_header(header)
        buffers = self._take_input(Action(s, ActionKind.F, i), state)
        return tuple(
            b.item() if flag else b
            for b, (_, _, flag) in zip(buffers, self._meta[(prev, sender, self.pp_rank)])
        )

    def _recv_grads(self, s: int, i: int, state: _StepState) -> tuple:
        if self.ordered:
            sender = self._rank_running(s + 1, ActionKind.B, i)
            return tuple(self._receive(Transfer(ActionKind.B, s + 1, i, sender, self.pp_rank), state))
        return tuple(self._take_input(Action(s, ActionKind.B, i), state))

    # ---- ordered transfers (NCCL) -----------------------------------------------------------
    def _offer(
        self, transfer: Transfer, payload: list[torch.Tensor], state: _StepState, header: torch.Tensor | None
    ) -> None:
        """A value produced for another rank (with its shape header the first time): issued now,
        after whatever comes before it between us."""
        state.outbox[transfer] = (header, [x.detach().contiguous() for x in payload])
        self._advance(transfer.dst, state, until=transfer)

    def _receive(self, transfer: Transfer, state: _StepState) -> list[torch.Tensor]:
        """Wait for ``transfer`` (issuing its receive, and what comes before it, if not done yet)."""
        if transfer not in state.inbox:
            self._advance(transfer.src, state, until=transfer)
        buffers, works = state.inbox.pop(transfer)
        for work, what, peer in works:
            self._wait(work, what, peer)
        return buffers

    def _advance(self, peer_pp: int, state: _StepState, until: Transfer | None) -> None:
        """Issue the transfers between this rank and ``peer_pp`` in their order, up to ``until``
        (waiting for a shape header on the way if need be), or without ``until`` as far as they
        can go without waiting: to a value this rank has not produced yet or to activations whose
        shapes have not arrived. A transfer's tensors go as one batched isend/irecv group (its
        shape header, when it has one, as a group before them, on both sides alike), and each
        waits for its own group only."""
        channel = self._channels.get(peer_pp, ())
        k = state.cursor.get(peer_pp, 0)
        while k < len(channel):
            t = channel[k]
            if t.src == self.pp_rank:
                if t not in state.outbox:
                    break
                header, payload = state.outbox.pop(t)
                if header is not None:
                    self._issue(peer_pp, dist.isend, [header], state.sends, f"{t}'s shapes")
                self._issue(peer_pp, dist.isend, payload, state.sends, str(t))
            else:
                buffers = self._receive_buffers(t, state)
                if buffers is None:  # the activations' shapes come in their header, first
                    if t not in state.headers:
                        header = torch.empty(_ORDERED_HEADER, dtype=torch.int64, device=self.device)
                        state.headers[t] = (header, [])
                        self._issue(peer_pp, dist.irecv, [header], state.headers[t][1], f"{t}'s shapes")
                    if until is None:
                        break
                    header, works = state.headers.pop(t)
                    for work, what, peer in works:
                        self._wait(work, what, peer)
                    self._meta[(t.stage, t.src, t.dst)] = _parse_header(header)
                    buffers = self._receive_buffers(t, state)
                state.inbox[t] = (buffers, [])
                self._issue(peer_pp, dist.irecv, buffers, state.inbox[t][1], str(t))
            k += 1
            state.cursor[peer_pp] = k
            if t == until:
                break

    def _receive_buffers(self, t: Transfer, state: _StepState) -> list[torch.Tensor] | None:
        if t.kind is ActionKind.F:
            meta = self._meta.get((t.stage, t.src, t.dst))
            if meta is None:
                return None
            return self._activation_buffers(t.stage, t.microbatch, meta, state)
        saved = state.saved[(t.stage - 1, t.microbatch)]  # its forward ran: see transfers.py
        return [torch.empty(o.shape, dtype=o.dtype, device=o.device) for o in _floats(saved[1])]

    def _issue(self, peer_pp: int, op, tensors: list[torch.Tensor], into: list, what: str) -> None:
        """One batched group of ``op`` (isend or irecv) of ``tensors`` with ``peer_pp``, on the
        pair's own process group; its work goes to ``into``."""
        if not tensors:
            return
        peer = self._peer(peer_pp)
        group = self._pair_groups[peer_pp]
        direction = "to" if op is dist.isend else "from"
        try:
            works = dist.batch_isend_irecv([dist.P2POp(op, _wire(x), peer, group) for x in tensors])
        except RuntimeError as err:
            raise self._lost(
                f"the connection failed moving {what} {direction} rank {peer}", err, peer
            ) from None
        # NCCL hands back one work for the whole group, gloo one per tensor.
        for work in works:
            into.append((work, f"{what} {direction} rank {peer}", peer))

    def _wait(self, work, what: str, peer: int | None = None) -> None:
        Deadline(self.rank, self.timeout_s).wait(work, what, peer)

    def _lost(self, what: str, err: BaseException, peer: int | None) -> RankLostError:
        return Deadline(self.rank, self.timeout_s).lost(what, err, peer)

    def _reduce_gradients(self, params: list[torch.nn.Parameter]) -> None:
        for group, tied in self.tied:
            self._all_reduce_flat(tied, group, "the gradient all-reduce of parameters held on several ranks")
        if self.dp_group is None:
            return
        self._all_reduce_flat(
            params, self.dp_group, f"the data-parallel gradient all-reduce over ranks {self.dp_ranks}"
        )

    def _all_reduce_flat(self, params: Sequence[torch.nn.Parameter], group: Any, what: str) -> None:
        sum_gradients(params, group, Deadline(self.rank, self.timeout_s), what, self._flat, self.device)


def drop_unused_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """``grad = None`` for the parameters whose gradient is zero everywhere, after a packed step
    without a single image: eager training on that step never runs the vision encoder, so its
    parameters get no gradient and AdamW skips them (no momentum step, no weight decay); here each
    microbatch ran the encoder on a stand-in image whose features reach no token, which gives
    exact zeros. Every rank holds the reduced gradients, so every rank drops the same ones."""
    for p in params:
        if p.grad is not None and not bool(p.grad.any()):
            p.grad = None


def _parse_header(header: torch.Tensor) -> list[tuple[tuple[int, ...], torch.dtype, bool]]:
    """(shape, dtype, is a Python number) of each value a shape header describes."""
    values = header.tolist()
    meta, pos = [], 1
    for _ in range(values[0]):
        flag, dtype, ndim = values[pos], _DTYPES[values[pos + 1]], values[pos + 2]
        meta.append((tuple(values[pos + 3 : pos + 3 + ndim]), dtype, bool(flag)))
        pos += 3 + ndim
    return meta


def _same_batch(a: Mapping[str, Any], b: Mapping[str, Any]) -> bool:
    """Whether two batches hold the same keys and values."""
    if set(a) != set(b):
        return False
    for key, x in a.items():
        y = b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            same = isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.shape == y.shape
            if not (same and x.dtype == y.dtype and torch.equal(x, y)):
                return False
        elif x != y:
            return False
    return True


def _first_difference(got: torch.Tensor, expected: torch.Tensor) -> str:
    if got.shape != expected.shape:
        return f"has shape {list(got.shape)}, the captured one {list(expected.shape)}"
    if got.numel() <= 16:
        return f"is {got.tolist()}, but the pipeline was captured for {expected.tolist()}"
    where = tuple(int(i) for i in (got != expected.to(got.device)).nonzero()[0])
    return (
        f"is {got[where].item()} at {list(where)}, but the pipeline was captured for {expected[where].item()}"
    )


def _to_device(microbatch: Mapping[str, Any], device: torch.device) -> dict[str, Any]:
    return {
        k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
        for k, v in microbatch.items()
    }


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What goes over the wire for ``t``: complex tensors as their real view (gloo has no complex
    types), int16 as bytes (NCCL has no int16); either view shares the buffer's storage."""
    if t.is_complex():
        return torch.view_as_real(t.resolve_conj())
    if t.dtype == torch.int16:
        return t.reshape(-1).view(torch.uint8)
    return t


def _floats(values) -> list[torch.Tensor]:
    return [x for x in values if isinstance(x, torch.Tensor) and x.is_floating_point()]
