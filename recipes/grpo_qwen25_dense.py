"""GRPO on Qwen2.5 dense (the paper's 7B/32B family).

With no arguments: a small randomly initialized Qwen2.5-style dense model (preset qwen2.5-tiny: 4 layers,
4 heads with 2 kv heads, q/k/v bias, no experts) learns the built-in task "max_digit" (prompt `max:381920=`,
answer `9`, reward 1 for the exact answer) from scratch with GRPO on the CPU, on 2 processes (update tp=2,
generation dp=2). Its entropy bonus keeps it from settling on always answering 9 (right 47% of the time).

With flags it is recipes/grpo_qwen3_moe.py with other defaults and takes all its flags: --model a Qwen2.5
checkpoint directory (e.g. Qwen2.5-7B-Instruct), --dataset, --reward, --world and the layouts, ... (see --help).
"""

from rlflow.startup import loading

with loading():  # Ctrl-C while the libraries load: one line
    from rlflow.recipe import main

DEFAULTS = {"preset": "qwen2.5-tiny", "entropy_coef": 0.01}

if __name__ == "__main__":
    main(defaults=DEFAULTS, doc=__doc__)
