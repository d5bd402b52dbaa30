"""The distributed runtime: one rank's share of a plan, executed on torch.distributed.

:class:`PipelineRunner` holds the stage modules codegen made and interprets its rank's lowered
list (:mod:`vlmcompile.ir.program`): compute actions (``2F0``, ``2B0``, ...) and the sends and
receives between them, in order. Its transport (:mod:`vlmcompile.runtime.transport`: by tag on
gloo, in each pair's one order on NCCL) carries those out; gradients of the stages a
data-parallel group replicates are summed over that group, and parameters tied across pipeline
ranks (an LLM's embedding and output layer) are summed over the ranks that hold them, as
Megatron-LM does (its process groups: :mod:`vlmcompile.runtime.groups`).

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
from vlmcompile.ir.errors import PlanError
from vlmcompile.ir.microbatch import label_weights
from vlmcompile.ir.packed import BatchPlan, PackedBatch, PackedLayout
from vlmcompile.ir.plan import Plan
from vlmcompile.ir.program import Comm, CommKind, Transfer, lower, transfer_order
from vlmcompile.runtime.autocast import forward_context, step_context
from vlmcompile.runtime.batches import (
    BatchError,
    agreed_schedule,
    check_dict_batch,
    microbatches_of,
    packed_sizes,
    schedule_actions,
    to_device,
)
from vlmcompile.runtime.capabilities import (
    RunnablePlan,
    check_forward_only,
    check_packed_run_ahead,
    runnable,
    stages_after_trainable,
)
from vlmcompile.runtime.collectives import Deadline, RankLostError
from vlmcompile.runtime.gradients import OverlappedReduction, added_to_held, drop_unused_gradients
from vlmcompile.runtime.groups import make_groups
from vlmcompile.runtime.run_ahead import RunAhead
from vlmcompile.runtime.split_backward import backward_from, input_gradients, weight_gradients
from vlmcompile.runtime.stage import (
    StageModule,
    move_stage,
    original_parameters,
    original_state,
    parameters_of,
)
from vlmcompile.runtime.transport import Buffers, Exchange, OrderedTransport, TaggedTransport
from vlmcompile.runtime.wire import floats

__all__ = ["BatchError", "PipelineRunner", "RankLostError", "keep_freed_memory"]


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
    produced: dict[Action, tuple] = field(default_factory=dict)
    """Action -> its output for another rank, until its ``SEND``."""
    exchange: Exchange = field(default_factory=Exchange)
    """The transfers in flight (:mod:`vlmcompile.runtime.transport`)."""
    pending: dict[tuple[int, int], Any] = field(default_factory=dict)
    """(stage, microbatch) -> what its W action computes, left by its I (:mod:`.split_backward`)."""


class PipelineRunner:
    """One rank's part of a compiled pipeline. Build it on every rank (``CompiledPipeline.runner``)
    after ``torch.distributed`` is initialised, or let ``CompiledPipeline.launch`` do both.

    ``plan``: a :class:`~vlmcompile.runtime.capabilities.RunnablePlan` (checked once on its way
    here, ``compiled_pipeline.make_runner``), or a plan, which is checked here."""

    def __init__(
        self,
        plan: Plan | RunnablePlan,
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
        checked = plan if isinstance(plan, RunnablePlan) else runnable(plan)  # never run a plan unchecked
        self.plan, self.parallel, self._lowered = checked.plan, checked.parallel, checked.program
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
        self._autocast_dtype = autocast_dtype
        self.transfers = transfers
        """``tagged`` (gloo), ``ordered`` (NCCL), ``auto``: tagged on gloo, ordered otherwise
        (:mod:`vlmcompile.runtime.transport`)."""
        self.packed = packed
        """The layout of a pipeline captured once for packed microbatches; its steps take a
        :class:`PackedBatch`."""
        self.per_batch_schedules = False
        """Each step runs the schedule of the batch global rank 0 holds (``PackedBatch.schedule``,
        broadcast by rank 0 at the step's start; none: the plan's actions). Every rank must agree."""
        self.run_ahead = RunAhead(self._ahead_state, self._run_stage)
        self.state_names = dict(state_names) if state_names is not None else None
        """Original name -> every name the original model's ``state_dict`` gives that tensor (tied
        parameters have several; non-persistent buffers none); None: parameters under their
        captured names only."""
        self._ready = False

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """Mixed precision: the stages' forwards run under ``torch.autocast`` in this dtype
        (bf16), while parameters, their gradients and the gradient reduction stay fp32. Set it
        alike on every rank, between steps."""
        return self._autocast_dtype

    @autocast_dtype.setter
    def autocast_dtype(self, dtype: torch.dtype | None) -> None:
        if dtype != self._autocast_dtype and self._ready:
            # The values sent between stages change dtype: the receivers learn them again, and
            # outputs made a batch ahead are made again.
            self.transport.meta.clear()
            self.drop_carried()
        self._autocast_dtype = dtype

    # ---- set-up --------------------------------------------------------------------------
    def setup(self) -> None:
        """Pick this rank's stages, make the process groups and the transport (every rank must
        call it)."""
        if self._ready:
            return
        backend, self.device = _backend(self.parallel, self.device, self.transfers)
        self.ordered = self.transfers == "ordered" or (self.transfers == "auto" and backend != "gloo")
        # NCCL's watchdog times every operation from when it was issued, and tears the process
        # down at the group's timeout: give it room past ours, so our wait names the lost peer.
        group_timeout = (
            self.timeout if backend == "gloo" else datetime.timedelta(seconds=2 * self.timeout_s + 30)
        )
        self.rank = dist.get_rank()
        self.pp_rank, self.dp_rank, _ = self.parallel.coords(self.rank)
        self.stages = {s.index: self.stages_all[s.index] for s in self.plan.stages_on(self.pp_rank)}
        self._trains_before = stages_after_trainable(self.stages_all)
        self._forward_only = check_forward_only(self.plan, self.stages_all, self._trains_before)
        check_packed_run_ahead(self.plan, packed=self.packed is not None)  # runnable() checked the rest
        if self.device.type != "cpu":
            for stage in self.stages.values():
                move_stage(stage, self.device)
        pairs = (
            sorted({tuple(sorted((r, p))) for r, peers in transfer_order(self.plan).items() for p in peers})
            if self.ordered
            else ()
        )
        self.groups = make_groups(
            self.plan, self.parallel, self.stages_all, self.rank, timeout=group_timeout, pair_peers=pairs
        )
        tied = {id(p) for _, held in self.groups.tied for p in held}  # summed over their holders first
        self.reduction = OverlappedReduction(self.stages, self.groups.dp, tied)
        self._flat: dict[int, torch.Tensor] = {}
        """Per gradient reduction (by its group's id): its flat buffer."""
        args = (self.pp_rank, self._peer, self.rank, self.timeout_s, self.device, self.plan)
        if self.ordered:
            self.transport = OrderedTransport(*args, channels={}, pair_groups=self.groups.pairs)
        else:
            self.transport = TaggedTransport(*args)
        self._use_plan(self.plan, self._lowered)
        if backend == "nccl":
            # NCCL leaves batched p2p undefined when it is a group's first operation and not every
            # member takes part: one collective over all ranks first.
            self._wait(dist.barrier(async_op=True), "the barrier that opens NCCL's communicator")
        self._ready = True

    def _use_plan(self, plan: Plan, program) -> None:
        """Run ``plan``'s lowered list (of ``program``, its lowered lists) from the next step on,
        its transfers' order with it."""
        channels = transfer_order(plan).get(self.pp_rank, {}) if self.ordered else {}
        if set(channels) - set(self.groups.pairs):
            raise PlanError(
                f"the batch's schedule has pipeline rank {self.pp_rank} exchange values with pipeline ranks "
                f"{sorted(set(channels) - set(self.groups.pairs))}, which the plan's never do (ordered "
                "transfers open a communicator per pair at set-up); re-plan within the plan's pairs"
            )
        if self.ordered:
            self.transport.channels = channels
        self._step_plan = plan
        """The plan whose actions the steps run now (:meth:`use_schedule`)."""
        self.program = program[self.pp_rank]
        """This rank's lowered list: its actions, and the sends and receives between them."""
        self.actions = plan.actions[self.pp_rank]
        self.rank_of_action = plan.rank_of_action()
        self._split = plan.split_backward()
        self.reduction.use_actions(self.actions, self.plan.actions[self.pp_rank])

    # ---- what the user's optimizer sees ----------------------------------------------------
    def parameter_owners(self) -> dict[int, bool]:
        """id(parameter) -> whether this rank counts it in whole-model sums (a gradient norm):
        a parameter held on several pipeline ranks counts on the lowest."""
        self.setup()
        return {id(p): min(self.groups.holders[id(p)]) == self.pp_rank for p in self.parameters()}

    def parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters, frozen ones (``requires_grad=False``) included."""
        self.setup()
        return parameters_of(self.stages.values())

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """This rank's parameters that train (what an optimizer is built over): a frozen one gets
        no gradient, as in eager, so it has no optimizer state, norm or reduction either."""
        return [p for p in self.parameters() if p.requires_grad]

    def named_parameters(self) -> dict[str, torch.nn.Parameter]:
        """This rank's parameters under the original model's names."""
        self.setup()
        return original_parameters(self.stages.values())

    def named_state(self) -> dict[str, torch.Tensor]:
        """This rank's share of the original model's ``state_dict`` (what a checkpoint holds)."""
        self.setup()
        return original_state(self.stages.values(), self.state_names)

    # ---- one training step -----------------------------------------------------------------
    def check_batch(self, batch: Mapping[str, Any] | PackedBatch) -> None:
        """A :class:`BatchError` naming the first way ``batch`` is not what the pipeline takes."""
        check_step_batch(self, batch)

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
        state = self._step_state(batch)
        if self.per_batch_schedules:
            self.use_schedule(agreed_schedule(batch, self.rank, self._lost))
        ahead = None
        if self.plan.ahead:
            self.run_ahead.start(self.plan, batch, state, self.actions, self.rank_of_action, self.pp_rank)
            if next_batch is not None:
                self.check_batch(next_batch)
                ahead = self._ahead_state(next_batch)
        self._state = state  # what the on_action hook may look at (tests: the receives posted ahead)
        self.transport.buffers = Buffers(
            planned=lambda stage, i: planned_shapes(self.stages_all[stage], state.sizes, i),
            outputs=lambda stage, i: floats(state.saved[(stage, i)][1]),
        )
        params, deadline = self.parameters(), Deadline(self.rank, self.timeout_s)
        with added_to_held(params), step_context(self.autocast_dtype, self.device):
            self.reduction.start_step()
            self._interpret(state, ahead)
            if ahead is not None:
                self.run_ahead.keep(next_batch, ahead)
            self.transport.finish(state.exchange)
            rest = [p for p in params if id(p) not in self.reduction.bucket_of]  # tied: summed, then reduced
            self.groups.reduce_gradients(rest, deadline, self._flat, self.device)
            self.reduction.finish(
                deadline, f"the data-parallel gradient all-reduce over ranks {list(self.groups.dp_ranks)}"
            )
            if isinstance(batch, PackedBatch) and not batch.images:
                drop_unused_gradients(params)
        loss = state.loss_sum.clone()
        self._wait(dist.all_reduce(loss, async_op=True), "the loss all-reduce")
        return loss.float()

    def _interpret(self, state: _StepState, ahead: _StepState | None) -> None:
        """This rank's lowered list, in order: a send hands its action's output to the transport,
        a receive posts its buffers, a compute action runs its stage."""
        ex = state.exchange
        for op in self.program:
            if isinstance(op, Comm):
                if op.kind is CommKind.RECV:
                    self.transport.post(op.transfer, ex)
                else:
                    t = op.transfer
                    names = self.stages_all[t.stage].send if t.kind is ActionKind.F else ()
                    self.transport.send(t, state.produced.pop(t.producer), names, ex)
                continue
            self.transport.before(ex)
            if self.on_action is not None:
                self.on_action(self.rank, op)
            with self.reduction.action(op):
                self._compute(op, state, ahead)

    def _compute(self, op: Action, state: _StepState, ahead: _StepState | None) -> None:
        if op in self.plan.ahead:
            if ahead is not None:  # without the next batch, the next step makes them
                self.run_ahead.forward(op, ahead)
        elif op.kind is ActionKind.F:
            self._forward(op, state)
        elif op.kind is ActionKind.W:
            weight_gradients(state.pending.pop((op.stage, op.microbatch), None))
        else:  # B, or I
            self._backward(op, state)

    def _step_state(self, batch: Mapping[str, Any] | PackedBatch) -> _StepState:
        """This rank's microbatches of ``batch`` and their loss weights."""
        if self.packed is not None or isinstance(batch, PackedBatch):
            self.setup()
            m = self.plan.num_microbatches
            mine = range(self.dp_rank * m, (self.dp_rank + 1) * m)
            sizes = packed_sizes(batch, self.plan, self.parallel, self.packed, mine)
            state = _StepState(
                microbatches=[batch.microbatches[i] for i in mine],
                weights=[1.0] * m,  # a packed microbatch's loss is already its share of the step's
                loss_sum=torch.zeros((), dtype=torch.float64, device=self.device),
                sizes=sizes,
            )
            if self.device.type != "cpu":
                state.microbatches = [to_device(mb, self.device) for mb in state.microbatches]
            return state
        self.check_batch(batch)
        self.setup()
        m = self.plan.num_microbatches
        weights = label_weights(batch, self.parallel.dp * m)
        return _StepState(
            microbatches=microbatches_of(batch, self.plan, self.dp_rank, self.sample_rows, self.device),
            weights=weights[self.dp_rank * m : (self.dp_rank + 1) * m],
            loss_sum=torch.zeros((), dtype=torch.float64, device=self.device),
        )

    # ---- forwards one batch ahead (Plan.ahead) ----------------------------------------------
    def drop_carried(self) -> None:
        """Forget the outputs made ahead for the next step (its step makes them again): call it
        when parameters change outside a step, as loading a checkpoint does."""
        self.run_ahead.carry = None

    @property
    def run_ahead_recomputed(self) -> int:
        """Steps whose run-ahead outputs this rank computed at their start."""
        return self.run_ahead.recomputed

    def _ahead_state(self, batch: Mapping[str, Any]) -> _StepState:
        """The state run-ahead forwards on ``batch`` work in (no loss, no gradients)."""
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        microbatches = microbatches_of(batch, self.plan, self.dp_rank, self.sample_rows, self.device)
        return _StepState(microbatches=microbatches, weights=(), loss_sum=zero)

    # ---- a schedule per batch ---------------------------------------------------------------
    def use_schedule(self, schedule: BatchPlan | None) -> None:
        """Run ``schedule``'s actions from the next step on (None: the plan's). They are checked
        as a plan's are (every action once, no deadlock) before any runs."""
        self.setup()
        actions = schedule_actions(self.plan, schedule, self.parallel.dp, self.dp_rank)
        if tuple(actions[self.pp_rank]) == tuple(self.actions) and actions == self._step_plan.actions:
            return
        plan = dataclasses.replace(self.plan, actions=tuple(tuple(a) for a in actions), kernel_level={})
        plan.validate()  # the plan's degrees and capabilities passed runnable(); its order is new
        self._use_plan(plan, lower(plan))

    # ---- compute actions --------------------------------------------------------------------
    def _forward(self, action: Action, state: _StepState) -> None:
        s, i = action.stage, action.microbatch
        if s == 0:
            received: tuple = ()
        else:
            received = self._input(
                Transfer(ActionKind.F, s - 1, i, self._rank_running(s - 1, ActionKind.F, i), self.pp_rank),
                state,
            )
        leaves, out = self._run_stage(s, received, state.microbatches[i])
        if s < self.plan.num_stages - 1:
            if s not in self._forward_only:  # no backward will read it
                state.saved[(s, i)] = (leaves, out)
            self._output(
                Transfer(ActionKind.F, s, i, self.pp_rank, self._rank_running(s + 1, ActionKind.F, i)),
                out,
                state,
            )
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
        with forward_context(self.autocast_dtype, self.device):
            return leaves, self.stages[s](leaves, microbatch)

    def _backward(self, action: Action, state: _StepState) -> None:
        """A whole backward (B), or its input gradients alone (I: its W comes later)."""
        s, i = action.stage, action.microbatch
        grads: tuple = ()
        if s < self.plan.num_stages - 1:  # a received gradient's buffers take the saved output's shapes
            grads = self._input(self._gradient(s + 1, i), state)
        leaves, out = state.saved.pop((s, i))
        outputs, grads = backward_from(out, grads, last=s == self.plan.num_stages - 1)
        if action.kind is ActionKind.B:
            if outputs:
                torch.autograd.backward(outputs, grads)
        elif outputs:
            state.pending[(s, i)] = input_gradients(outputs, grads, floats(leaves), self.stages[s])
        if s == 0 or s - 1 in self._forward_only:
            return  # no gradient goes back to a stage with nothing to train in or before it
        input_grads = tuple(x.grad if x.grad is not None else torch.zeros_like(x) for x in floats(leaves))
        self._output(self._gradient(s, i), input_grads, state)

    def _gradient(self, s: int, i: int) -> Transfer:
        """Stage ``s``'s input gradients of microbatch ``i``, from the rank that runs its backward
        (B, or I where split) to the one that runs stage ``s - 1``'s."""
        kind, before = (ActionKind.I if k in self._split else ActionKind.B for k in (s, s - 1))
        return Transfer(kind, s, i, self._rank_running(s, kind, i), self._rank_running(s - 1, before, i))

    def _input(self, t: Transfer, state: _StepState) -> tuple:
        """The value ``t`` brings this rank: kept here when it was made here, else received."""
        if t.src == self.pp_rank:
            return (state.local_fwd if t.kind is ActionKind.F else state.local_bwd).pop(
                (t.consumer.stage, t.microbatch)
            )
        return self.transport.take(t, state.exchange)

    def _output(self, t: Transfer, value: tuple, state: _StepState) -> None:
        """``t``'s value: kept for its consumer here, or for the ``SEND`` after its action."""
        if t.dst == self.pp_rank:
            local = state.local_fwd if t.kind is ActionKind.F else state.local_bwd
            local[(t.consumer.stage, t.microbatch)] = value
        else:
            state.produced[t.producer] = value

    # ---- collectives -------------------------------------------------------------------------
    def _rank_running(self, stage: int, kind: ActionKind, microbatch: int) -> int:
        """The pipeline rank that runs an action (a replicated stage runs each microbatch on one
        of its holders; ``Plan.validate`` checked that every action runs somewhere)."""
        return self.rank_of_action[Action(stage, kind, microbatch)]

    def _peer(self, pp_rank: int) -> int:
        return self.parallel.global_rank(pp_rank, self.dp_rank)

    def _wait(self, work, what: str, peer: int | None = None) -> None:
        Deadline(self.rank, self.timeout_s).wait(work, what, peer)

    def _lost(self, what: str, err: BaseException, peer: int | None) -> RankLostError:
        return Deadline(self.rank, self.timeout_s).lost(what, err, peer)


def _backend(parallel, device: torch.device | None, transfers: str) -> tuple[str, torch.device]:
    """The backend and the stages' device, after checking the world, the device and the
    transfers agree with the backend."""
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialised: start the ranks with torchrun, or use "
            "CompiledPipeline.launch(nprocs=N) to start N local ranks"
        )
    world, t = dist.get_world_size(), parallel
    if world != t.world_size:
        raise PlanError(
            f"the plan runs on {t.world_size} ranks (PP={t.pp} x DP={t.dp}), but torch.distributed has "
            f"{world}; start {t.world_size} ranks or plan for {world}"
        )
    backend = dist.get_backend()
    if device is None:
        cuda = backend == "nccl"
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PlanError(f"device {device} was asked for, but this machine has no CUDA device")
    if device.type != "cpu" and backend == "gloo":
        raise PlanError(
            f"stages on {device} need the NCCL backend (gloo sends CPU tensors only); initialise "
            "torch.distributed with backend='nccl', or run on the CPU"
        )
    if backend == "gloo":
        keep_freed_memory()
    if backend != "gloo" and transfers == "tagged":
        raise PlanError(f"transfers='tagged' needs gloo: {backend} ignores tags; use 'ordered' or 'auto'")
    return backend, device


def planned_shapes(
    stage, sizes: list[dict[str, int]] | None, microbatch: int
) -> list[tuple[int, ...]] | None:
    """The shapes of what ``stage`` sends for ``microbatch``, known before the step from the step's
    size symbols (``sizes``: per microbatch; packed pipelines), or None."""
    if sizes is None:
        return None
    return [f.evaluate(sizes[microbatch]) for f in stage.send_shapes]


def check_step_batch(runner: PipelineRunner, batch: Mapping[str, Any] | PackedBatch) -> None:
    """:meth:`PipelineRunner.check_batch`: a packed pipeline's :class:`PackedBatch`, or a dict
    of the compiled shapes, constants and specialised values."""
    if runner.packed is not None or isinstance(batch, PackedBatch):
        microbatches = range(len(getattr(batch, "microbatches", ())))
        packed_sizes(batch, runner.plan, runner.parallel, runner.packed, microbatches)
        return
    check_dict_batch(
        batch,
        runner.plan,
        runner.parallel,
        shapes=runner.batch_shapes,
        constants=runner.batch_constants,
        specialized=runner.specialized,
        sample_rows=runner.sample_rows,
    )
