"""Step 1 of a profile: the reference, plain and profiled runs per prompt, token-forced.

Per prompt, interleaved so that machine drift hits all three alike: the AR reference, the plan
without the profiler (tau_actual, wall time per step; the kernel classes of a forward run as one
op call, timed by its own clock: :func:`specpilot.profiling.clocking`) and the plan under
torch.profiler with the kernel ranges on (kernel time of every other class). Each of the two
plan runs has its own drafter, fed the prompts in the same order.

Both plan runs go through :func:`specpilot.forcing.check` against the references as soon as they
exist: a plan whose output differs from plain decoding is lossy, and timing it would measure the
wrong thing. The first failing run stops the profile with :class:`LossyPlanError`, which carries
the forcing report (no further prompt is run, nothing is replayed or timed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from specpilot.costmodel.measure import ClassTimes, profiled
from specpilot.costmodel.roofline import trained_net
from specpilot.drafters.base import Drafter
from specpilot.engine import Engine, GenerationConfig, GenerationResult
from specpilot.errors import SpecPilotError
from specpilot.forcing import ForcingReport, Reference, check
from specpilot.profiling import clocking
from specpilot.tree import TreeSpec

ProgressFn = Callable[[str, int, int], None]
"""``progress(phase, done, total)``; phases: "run", "replay", "step cost"."""


class LossyPlanError(SpecPilotError):
    """The plan's speculative output differs from plain decoding; the profile stopped.

    ``forcing`` is the report of the run that failed (over the prompts run so far) and ``run``
    names it ("plain" or "profiled")."""

    def __init__(self, run: str, forcing: ForcingReport) -> None:
        super().__init__(
            f"the plan is lossy, profile stopped: its {run} run differs from plain decoding "
            f"({forcing.summary()}); fix the drafter or plan before profiling it"
        )
        self.run = run
        self.forcing = forcing


@dataclass(frozen=True)
class Forcing:
    """How strictly the plan's runs are forced against the references."""

    strict: bool = True
    """Any divergence stops the profile; non-strict tolerates near-ties."""
    near_tie: float = 1e-3
    """Reference top-1 minus top-2 logit below which a divergence is a near-tie."""


@dataclass
class Runs:
    """What step 1 measured; ``forcing`` holds the plain and profiled runs' reports (PASS)."""

    refs: list[GenerationResult]
    plain: list[GenerationResult]
    profiled: list[GenerationResult]
    times: ClassTimes
    forcing: tuple[ForcingReport, ForcingReport]
    draft_forwards: int = 0
    """Forwards of the profiled run's trained drafter (head / block), if it has one."""

    @property
    def mismatches(self) -> int:
        """Prompts with a (tolerated) divergence in either plan run."""
        return len({d.prompt_id for rep in self.forcing for d in rep.divergences})


def prompt_keys(prompts: Sequence[tuple[str, list[int]]]) -> list[str]:
    """Prompt ids, made unique (``id#index``) where a workload repeats one."""
    ids = [pid for pid, _ in prompts]
    if len(set(ids)) == len(ids):
        return ids
    return [f"{pid}#{i}" for i, pid in enumerate(ids)]


def force(
    refs: Sequence[Reference], outs: dict[str, list[int]], how: Forcing, run: str
) -> ForcingReport:
    """Check ``outs`` against ``refs`` (the prompts run so far); raise when the check fails."""
    rep = check(refs, outs, strict=how.strict, near_tie=how.near_tie)
    if not rep.ok:
        raise LossyPlanError(run, rep)
    return rep


def timed_runs(
    engine: Engine,
    prompts: Sequence[tuple[str, list[int]]],
    make_drafter: Callable[[], Drafter | None],
    spec: TreeSpec,
    gen: GenerationConfig,
    eos_ids: tuple[int, ...],
    how: Forcing | None = None,
    progress: ProgressFn | None = None,
) -> Runs:
    """Step 1 (module docstring). ``make_drafter()`` returning None runs plain AR decoding: the
    reference is then the plain run itself. Raises :class:`LossyPlanError` at the first prompt
    where a plan run diverges."""
    how = how or Forcing()
    d_plain, d_prof = make_drafter(), make_drafter()
    speculative = d_plain is not None
    ref_gen = replace(gen, record_margins=True) if speculative else gen  # margins: near-ties
    out = Runs([], [], [], ClassTimes(), (_empty(), _empty()))
    references: list[Reference] = []
    plain_out: dict[str, list[int]] = {}
    prof_out: dict[str, list[int]] = {}
    reps = out.forcing
    for i, (key, (_, ids)) in enumerate(zip(prompt_keys(prompts), prompts, strict=True)):
        with clocking() as clock:  # the plain decoding reference is the plan's run without one
            ref = engine.generate(ids, ref_gen, eos_ids=eos_ids)
            plain_clock = dict(clock)
        margins = tuple(ref.margins) if ref.margins else None
        references.append(Reference(key, tuple(ref.tokens), margins))
        run = ref
        if speculative:
            with clocking() as clock:
                run = engine.generate(ids, gen, drafter=d_plain, spec=spec, eos_ids=eos_ids)
                plain_clock = dict(clock)
        out.times.add_clocked(plain_clock)
        plain_out[key] = run.tokens
        plain_rep = force(references, plain_out, how, "plain")
        prof, ct = profiled(
            lambda ids=ids: engine.generate(ids, gen, drafter=d_prof, spec=spec, eos_ids=eos_ids),
            engine.model.device,
        )
        prof_out[key] = prof.tokens
        reps = (plain_rep, force(references, prof_out, how, "profiled"))
        out.refs.append(ref)
        out.plain.append(run)
        out.profiled.append(prof)
        out.times.add(ct)
        if progress is not None:
            progress("run", i + 1, len(prompts))
    out.forcing = reps
    trained = trained_net(d_prof)
    out.draft_forwards = int(getattr(trained, "forwards", 0))
    return out


def _empty() -> ForcingReport:
    return check([], {})
