"""Tools: Python functions the model calls through its chat template's tool format, and ``ToolEnv``, the
environment that runs them (``--env tools --tools calculator,path/to/file.py``).

The prompt shows the tools' schemas (``schema``: OpenAI's function format, which ``apply_chat_template(...,
tools=...)`` renders into the system message). The model calls one in its turn as Qwen and Hermes templates ask,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; ``ToolEnv`` runs each call and answers with one
tool message per call. A call that is not JSON, names no known tool or whose arguments the function refuses is
answered with an error message the model reads (counted ``env/tool_errors``), never raised. A turn without a call
is the final answer: the episode ends and the run's reward scores it.
"""

from __future__ import annotations

import ast
import inspect
import json
import operator
import re
from typing import Callable

from rlflow.envs.base import Feedback


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression of numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 12"."""
    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.USub: operator.neg,
           ast.UAdd: operator.pos}

    def small(v):  # the interpreter cannot be interrupted inside one big-integer operation: bound every value
        if isinstance(v, int) and v.bit_length() > MAX_BITS:
            raise ValueError(f"a value above 2**{MAX_BITS}")
        return v

    def ev(n):
        if isinstance(n, ast.Constant) and isinstance(n.value, (int, float)) and not isinstance(n.value, bool):
            return small(n.value)
        if isinstance(n, ast.BinOp) and type(n.op) in ops:
            a, b = ev(n.left), ev(n.right)
            if isinstance(n.op, ast.Pow) and isinstance(a, int) and isinstance(b, int) and abs(a) > 1 \
                    and b * a.bit_length() > MAX_BITS + 64:
                raise ValueError(f"a value above 2**{MAX_BITS}")
            return small(ops[type(n.op)](a, b))
        if isinstance(n, ast.UnaryOp) and type(n.op) in ops:
            return ops[type(n.op)](ev(n.operand))
        raise ValueError(f"not arithmetic: {ast.unparse(n)!r}")
    try:
        value = ev(ast.parse(expression, mode="eval").body)
    except SyntaxError:
        raise ValueError(f"not an expression: {expression!r}") from None
    return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)


MAX_BITS = 4096  # the calculator's largest integer
TOOLS: dict[str, Callable] = {"calculator": calculator}
_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def load_tools(spec: str) -> dict[str, Callable]:
    """The tools of ``spec``, comma-separated built-in names (``TOOLS``) and files whose public functions are
    each a tool (named after the function, described by its docstring and signature). ValueError naming the part
    that is wrong."""
    from rlflow.rewards import import_file

    out: dict[str, Callable] = {}
    for part in (p.strip() for p in spec.split(",")):
        if part in TOOLS:
            out[part] = TOOLS[part]
            continue
        if not part.endswith(".py"):
            raise ValueError(f"tools {part!r}: not a built-in tool ({sorted(TOOLS)}) and not a path/to/file.py")
        mod = import_file(part, "tools")
        found = {k: v for k, v in vars(mod).items() if inspect.isfunction(v) and not k.startswith("_")
                 and v.__module__ == mod.__name__}
        if not found:
            raise ValueError(f"tools {part}: defines no public function")
        out.update(found)
    for name, fn in out.items():
        schema(fn)  # a signature the format cannot describe is named now, not at the first call
    return out


def schema(fn: Callable) -> dict:
    """``fn`` in OpenAI's function format: its name, its docstring's first paragraph, each parameter's JSON type
    (from its annotation: str, int, float, bool, list, dict) and which are required."""
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        ann = p.annotation
        if isinstance(ann, str):  # ``from __future__ import annotations``
            ann = {t.__name__: t for t in _TYPES}.get(ann, ann)
        if ann not in _TYPES:
            raise ValueError(f"tool {fn.__name__}: parameter {p.name} needs an annotation among "
                             f"{[t.__name__ for t in _TYPES]}, got {p.annotation!r}")
        props[p.name] = {"type": _TYPES[ann]}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    doc = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
    return {"type": "function", "function": {"name": fn.__name__, "description": doc,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def tool_calls(turn: str) -> list[str]:
    """The bodies of the ``<tool_call>...</tool_call>`` blocks of a turn, in order; a call left open (cut by the
    turn's token limit) is one too, whose body is not JSON (its error answers it)."""
    calls = [m.strip() for m in _CALL.findall(turn)]
    rest = _CALL.sub("", turn)
    if "<tool_call>" in rest:
        calls.append(rest[rest.index("<tool_call>"):] + "  (no </tool_call>)")
    return calls


def run_call(body: str, tools: dict[str, Callable]) -> tuple[str, bool]:
    """(the tool message's content, whether the call was well-formed and ran) of one call's body."""
    try:
        call = json.loads(body)
    except ValueError as e:
        return f"error: the tool call is not JSON ({e})", False
    if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments", {}), dict)):
        return 'error: a tool call is {"name": <tool>, "arguments": {...}}', False
    fn = tools.get(call["name"])
    if fn is None:
        return f"error: no tool {call['name']!r}; the tools are {sorted(tools)}", False
    try:
        return str(fn(**call.get("arguments", {}))), True
    except Exception as e:  # the model's arguments: its error to read, not the run's
        return f"error: {call['name']} raised {type(e).__name__}: {e}", False
    except SystemExit as e:  # a tool that calls sys.exit (a script's habit) ends its call, not the episode
        return f"error: {call['name']} exited (SystemExit: {e.code})", False


class ToolEnv:
    """Runs the tool calls of each turn (``tools``: the run's, name -> function) and answers with their results,
    one tool message per call; a turn without a call ends the episode (the run's reward scores that answer)."""

    COUNTS = ("tool_calls", "tool_errors")

    def __init__(self, example, *, tools: dict[str, Callable]):
        self.tools = tools

    def step(self, turn: str) -> Feedback:
        calls = tool_calls(turn)
        if not calls:
            return Feedback(done=True)
        results = [run_call(c, self.tools) for c in calls]
        return Feedback(observation=[{"role": "tool", "content": text} for text, _ in results],
                        counts={"tool_calls": len(results), "tool_errors": sum(not ok for _, ok in results)})


__all__ = ["TOOLS", "ToolEnv", "calculator", "load_tools", "run_call", "schema", "tool_calls"]
