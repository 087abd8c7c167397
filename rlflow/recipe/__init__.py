"""The GRPO recipe's machinery: every flag of ``recipes/grpo_qwen3_moe.py`` (and of the recipes that reuse it with
other defaults, ``recipes/grpo_qwen25_dense.py``) as a field of ``Recipe``, the checks that refuse a value by its
flag before anything runs, and the run: the model (a checkpoint or a preset's random init), the data, the reward,
the layouts and the dock built from the flags, ``rlflow.runtime.loop.train`` on every rank, checkpoints,
evaluation, metrics sinks and the reward plot.

``main(argv, defaults, doc)`` is what a recipe script calls: ``defaults`` replace ``Recipe``'s field defaults
and ``doc`` is the --help text.
"""

# flags.py   Recipe (every flag, its default and --help), the choices of a flag
# checks.py  the refusals by flag: the rules no config owns, and the configs' own errors mapped onto the flags
# data_checks.py  the refusals of what the run trains and evaluates on: dataset or task, template, rewards, eval set
# pieces.py  the run's pieces of the flags: model, configs, prompts and reward, layouts, transfer dock, build
# evals.py   the eval set, --eval-only, a run's evaluation over its ranks
# driver.py  parse_args, main (picks the launcher; nothing per rank), run_started, run_on_ray, prepare_out,
#            holding_out (one run per --out)
# run.py     run: the recipe on one rank

from rlflow.recipe.driver import holding_out, main, parse_args, prepare_out, run_on_ray
from rlflow.recipe.flags import Recipe
from rlflow.recipe.pieces import build

__all__ = ["Recipe", "build", "holding_out", "main", "parse_args", "prepare_out", "run_on_ray"]
