"""The rollout pool's loop (separate device pools, ``runtime.pools``): generate, score and put each step's
rows into the dock while the train pool trains on earlier ones.

Step j is generated with the newest version of the policy every rollout rank has received (with partial
rollout, the newest this rank has), and at least version j - k (``LoopConfig.max_staleness``; the pool
waits for it): so no row is ever trained on more than k updates after the weights that sampled it, and
nothing is dropped. Its rows go to dock slot
j mod (k + 1): the train pool released that slot (the rows of step j - k - 1) before it pushed version
j - k, so the dock holds at most k + 1 steps of rows (the back-pressure), and a put never waits. At k = 0
every step is generated with the weights the synchronous run would use, with the same seeds.

Partial rollout (``LoopConfig.partial_rollout``): a version that lands while a step generates is swapped in
before the next decode step, and the rows in flight continue under it (``rollout.generate``'s ``newer``).
The rule above bounds the oldest token, the one the step started with; every token records its version.

The loop reads the prompt stream the train pool reads (the same source, seed and position), from the step
the train pool starts at (the first version's number, so a resumed run continues its stream).
"""

from __future__ import annotations

from rlflow.runtime.step import Clock, StepContext, generate, prompts_at, score_and_put


def produce(source, ctx: StepContext) -> None:
    """Produce steps until the train pool says stop (or the run's last step is produced); ``ctx.pool`` is this
    rank's end of the link (a ``pools.RolloutSide``)."""
    conf, side = ctx.config, ctx.pool
    k, P, G = conf.max_staleness, conf.prompts_per_step, conf.grpo.group_size
    first = side.first_version()
    if first is not None:
        for _ in range(first):  # the stream's position at the step the train pool starts at
            source.take(P)
        j, held = first, [None]  # the version the engine holds

        def newer():  # partial rollout: the engine swaps it in mid-generation
            got = side.newer()
            if got is not None:
                held[0] = got[0]
            return got
        while j < conf.steps and (got := side.weights_for(j, k)) is not None:
            version, params, waited = got
            clock = Clock()
            prompts = prompts_at(source, j, ctx)
            ctx.flow.begin(prompts, G, slot=j % (k + 1))
            # the engine's load figures in the step that loaded a version, zeros in the others
            loads = dict.fromkeys(ctx.engine.figures(), 0.0)
            if version != held[0]:  # the devices are the pool's: the engine keeps its weights between steps
                ctx.engine.load(params)
                held[0], loads = version, ctx.engine.figures()
            rollout = generate(prompts, j, ctx, version=version, newer=newer if side.partial else None)
            clock.lap("rollout_time_s")
            report, _, _ = score_and_put(rollout, j, ctx, clock)
            report.version = version
            report.figures.times.update({"rollout_wait_s": waited, **loads})
            side.report(report)
            j += 1
    side.finish()


__all__ = ["produce"]
