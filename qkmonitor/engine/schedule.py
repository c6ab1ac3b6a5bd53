"""When an engine probes, and the steps between probes where a host may skip work.

A :class:`ProbeSchedule` holds the probe interval in effect (``every_n_steps``: the one given, or
the host's default from bind on), the step of the last training probe, and the plan for the steps
after it (:attr:`~ProbeSchedule.between_probes`, :attr:`~ProbeSchedule.quiet`). The engine asks it
and tells it what only the engine knows: whether a window is open, and how many steps before a
probe its rules read the loss.
"""

from __future__ import annotations

__all__ = ["NO_STEPS", "ProbeSchedule"]

#: no step (:attr:`ProbeSchedule.between_probes` and ``quiet`` before a batch has been seen)
NO_STEPS = range(0)


class ProbeSchedule:
    """The probe steps of one engine.

    Args:
        every_n_steps: the interval given (None: the host's default, set at bind).
        visuals_every_n_probes: the probes that draw the visuals (:meth:`draws_visuals`); 0: none.
    """

    def __init__(self, every_n_steps: int | None, visuals_every_n_probes: int = 0) -> None:
        self.every_n_steps = every_n_steps
        self.visuals_every_n_probes = visuals_every_n_probes
        #: the step of the last training probe
        self.latest_step: int | None = None
        #: steps at which a host skips all but the loss, and all (:meth:`steps_after`)
        self.between_probes, self.quiet = NO_STEPS, NO_STEPS

    def forget_plan(self) -> None:
        """Plan nothing ahead (a bind, a resume): the next batch is looked at."""
        self.between_probes, self.quiet = NO_STEPS, NO_STEPS

    def is_probe_step(self, step: int) -> bool:
        """Whether ``step`` (optimizer steps so far) is probed: the first step at or after each
        multiple of ``every_n_steps``. Under gradient accumulation several batches share a step and
        only the first probes; with two optimizers stepping once per batch the step advances by 2,
        and a multiple it skips is probed at the next step (every 5 steps: 0, 6, 10, 16, 20)."""
        every = self.every_n_steps
        if every is None or step == self.latest_step:
            return False
        return step % every == 0 or (
            self.latest_step is not None and step // every > self.latest_step // every
        )

    def steps_after(
        self, step: int, *, probing: bool, loss_lead: int, loss_smoothing: int
    ) -> tuple[range, range]:
        """The steps after ``step`` where a host may skip work, as ``(between_probes, quiet)``.

        ``between_probes``: steps up to the next multiple of ``every_n_steps`` once the probe of
        ``step``'s interval is done (the next interval's probe may land on any of its steps): no
        probe window opens there (:meth:`is_probe_step` is False) and no weights are read; only
        the loss may be kept. ``quiet``: those of them whose loss no rule reads either (the
        ``loss_lead`` steps before a probe, and the run's first ``loss_smoothing`` when any rule
        reads the loss), where a host skips everything. Both may be empty, and are while a window
        is open (``probing``); ``between_probes.stop`` is after ``step``, so the plan is made once
        per interval. At ``every_n_steps=50`` with the default rules: steps 1 to 49 after a probe
        at 0, of them 1 to 29 quiet (the rules read the 20 steps before a probe). A batch's hooks
        run between two training steps, when little of the monitor's code is in the CPU's caches:
        each line they skip there counts."""
        every, latest = self.every_n_steps, self.latest_step
        none = range(step + 1, step + 1)
        if every is None or probing or latest is None or latest > step:
            return none, none
        first = step - step % every  # the interval's first step, a multiple of every_n_steps
        if latest < first:  # the probe of this interval is still to come
            return none, none
        quiet_from = max(step + 1, loss_smoothing if loss_lead else 0)
        quiet = range(quiet_from, max(quiet_from, first + every - loss_lead))
        return range(step + 1, first + every), quiet

    def draws_visuals(self, step: int) -> bool:
        """Whether the probe at ``step`` draws the visuals: every ``visuals_every_n_probes``-th
        probe, counting the one at step 0."""
        every, visuals = self.every_n_steps or 1, self.visuals_every_n_probes
        return visuals > 0 and (step // every) % visuals == 0
