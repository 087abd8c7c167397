"""GRPO on Qwen3-MoE.

With no arguments: a small randomly initialized Qwen3-MoE (4 layers, 8 experts, top-2) learns the
built-in task "max_digit" (prompt `max:381920=`, answer `9`, reward 1 for the exact answer) from scratch
with GRPO on the CPU, and the reward rises within minutes.

With flags: --model loads a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json; its chat
template renders the prompts), --dataset a JSONL, JSON, CSV or Parquet file or a Hugging Face datasets folder of
{"prompt", "answer"} (GSM8K's {"question", "answer"} works too; reward "math"), --reward your own reward
function (path/to/file.py:function). See docs/data.md.

Every flag is a field of rlflow.recipe.Recipe, with its default and --help text; the run is rlflow/recipe/
(run.py on every rank, over rlflow/runtime/step.py).
"""

from rlflow.startup import loading

with loading():  # Ctrl-C while the libraries load: one line
    from rlflow.recipe import Recipe, build, main, parse_args, prepare_out  # noqa: F401  (what tests and bench/ import)

if __name__ == "__main__":
    main(doc=__doc__)
