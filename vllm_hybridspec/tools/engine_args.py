"""One set of engine and prompt options for every command that starts a vLLM engine in this process
(``compare``, ``evaluate``, ``calibrate capture|costs``, ``replay-record``, ``profile``, ``check``).

A command declares them by decoration and receives them as one object::

    @engine_options
    @prompt_options
    def compare(engine: EngineOptions, prompts: PromptOptions, out: Path = typer.Option(...)): ...

``--engine-args`` takes any other ``vllm.LLM`` keyword argument as JSON (``hf_overrides``,
``additional_config``, ``mamba_ssm_cache_dtype``, ``tensor_parallel_size``, ``compilation_config``...),
so no command repeats vLLM's flags one by one.
"""

from __future__ import annotations

import functools
import inspect
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import typer


def json_object(text: str | None, name: str) -> dict:
    """``text`` parsed as a JSON object (``None`` or empty: ``{}``); ``typer.BadParameter`` naming the
    option otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise typer.BadParameter(f"--{name} is not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise typer.BadParameter(f"--{name} must be a JSON object, got {text!r}")
    return value


def output_path(path: Path | None, option: str, directory: bool = False, make_parents: bool = True) -> None:
    """An output ``path`` (``None``: not asked for) checked before the command's work:
    ``typer.BadParameter`` when it is a directory (a file: ``directory=False``) or a file
    (``directory=True``), lies below a file, or cannot be written."""
    from vllm_hybridspec.policy.errors import InputError
    from vllm_hybridspec.policy.files import check_output_dir, check_writable

    if path is None:
        return
    try:
        if directory:
            check_output_dir(path, option)
        else:
            check_writable(path, option, make_parents=make_parents)
    except InputError as e:
        raise typer.BadParameter(str(e)) from None


def input_file(path: Path | None, option: str, what: str) -> None:
    """An input ``path`` (``None``: not given) must be a file; ``what`` says what it should hold."""
    if path is not None and not Path(path).is_file():
        problem = "is a directory" if Path(path).is_dir() else "does not exist"
        raise typer.BadParameter(f"{option} '{path}' {problem}; expected {what}")


def int_list(text: str, name: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]``; ``typer.BadParameter`` naming the option unless every item is a
    positive integer."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise typer.BadParameter(f"--{name} must be comma-separated positive integers, got {text!r}")
    return values


def scale_list(text: str, name: str) -> list[float]:
    """``"0.25,0.1"`` -> ``[0.25, 0.1]``; ``typer.BadParameter`` naming the option unless every item is a
    finite positive number."""
    import math

    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise typer.BadParameter(f"--{name} must be comma-separated positive numbers, got {text!r}")
    return values


@dataclass
class EngineOptions:
    """``vllm.LLM`` settings shared by the engine commands; ``llm_kwargs`` gives the keyword arguments."""

    model: str
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    gpu_memory_utilization: float | None = None
    load_format: str = "auto"
    enforce_eager: bool = False
    engine_args: dict[str, Any] = field(default_factory=dict)

    def llm_kwargs(self, **overrides) -> dict[str, Any]:
        """Keyword arguments of ``vllm.LLM``: the options set, then ``--engine-args``, then ``overrides``
        (what the command itself must fix, e.g. ``speculative_config``)."""
        kwargs: dict[str, Any] = {"model": self.model, "dtype": self.dtype, "load_format": self.load_format,
                                  "enforce_eager": self.enforce_eager, "skip_tokenizer_init": True, "seed": 0}
        for name in ("max_model_len", "max_num_seqs", "gpu_memory_utilization"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return {**kwargs, **self.engine_args, **overrides}


def reference_engine_options(out_dir: str | Path, kind: str, max_num_seqs: int = 4) -> EngineOptions:
    """The engine of the reference models ``out_dir/kind`` (``hybridspec demo``, the reference acceptance
    runs): bf16 with CUDA graphs on a GPU, float32 eager on the CPU; the hybrid's GDN
    state in float32."""
    import torch

    on_gpu = torch.cuda.is_available()
    extra = {"mamba_ssm_cache_dtype": "float32"} if kind == "hybrid" else {}
    if on_gpu and kind == "hybrid":
        extra["additional_config"] = {"gdn_prefill_backend": "triton"}
    return EngineOptions(model=str(Path(out_dir) / kind), dtype="bfloat16" if on_gpu else "float32",
                         max_model_len=512, max_num_seqs=max_num_seqs, gpu_memory_utilization=0.3 if on_gpu else None,
                         enforce_eager=not on_gpu, engine_args=extra)


@dataclass
class PromptOptions:
    """Where a command's prompts come from: a JSONL file, or random token ids."""

    prompts: Path | None = None
    random_prompts: bool = False
    num_prompts: int = 24
    prompt_len: int = 64
    vocab: int = 1000
    seed: int = 0

    def load(self, model: str) -> list[dict]:
        """Token-id prompts ``[{"prompt_token_ids": [...]}, ...]``: random ids, or a JSONL file's rows,
        each a ``prompt`` text (tokenised with ``model``'s tokenizer), a ``prompt`` list of token ids, or a
        ``prompt_token_ids`` list (so a ``hybridspec replay-record`` continuations file serves as is)."""
        import torch

        if self.random_prompts == (self.prompts is not None):
            raise typer.BadParameter("give --prompts FILE or --random-prompts (one of them)")
        if self.random_prompts:
            gen = torch.Generator().manual_seed(self.seed)
            lengths = torch.randint(self.prompt_len // 2, self.prompt_len + 1, (self.num_prompts,), generator=gen)
            return [{"prompt_token_ids": torch.randint(0, self.vocab, (int(n),), generator=gen).tolist()}
                    for n in lengths]
        path = Path(self.prompts)
        if not path.is_file():
            raise typer.BadParameter(f"--prompts {str(path)!r} does not exist")
        rows = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise typer.BadParameter(f"prompt file {str(path)!r}, line {i}: not JSON ({e})") from None
            if len(rows) == self.num_prompts:
                break
        if not rows:
            raise typer.BadParameter(f"prompt file {str(path)!r} holds no prompts")
        ids = [r.get("prompt_token_ids", r.get("prompt")) if isinstance(r, dict) else None for r in rows]
        kinds = [isinstance(x, list) for x in ids]
        if all(kinds):
            return [{"prompt_token_ids": [int(t) for t in x]} for x in ids]
        if any(kinds) or not all(isinstance(x, str) for x in ids):
            bad = next(i for i, x in enumerate(ids) if isinstance(x, list) != kinds[0] or not isinstance(x, (str, list)))
            raise typer.BadParameter(f"prompt file {str(path)!r}, row {bad + 1}: every row needs a 'prompt' text, or "
                                     f"every row a token-id list ('prompt' or 'prompt_token_ids'); got "
                                     f"{str(ids[bad])[:60]!r}")
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model)
        return [{"prompt_token_ids": tokenizer(r["prompt"], add_special_tokens=False).input_ids} for r in rows]


_ENGINE_OPTIONS = [
    inspect.Parameter("model", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                      default=typer.Option(..., "--model", "--target", help="target model (path or hub id), as for "
                                           "vllm serve")),
    inspect.Parameter("dtype", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                      default=typer.Option("auto", help="model dtype (auto, bfloat16, float32, ...)")),
    inspect.Parameter("max_model_len", inspect.Parameter.KEYWORD_ONLY, annotation=int | None,
                      default=typer.Option(None, min=1, help="vLLM's max_model_len")),
    inspect.Parameter("max_num_seqs", inspect.Parameter.KEYWORD_ONLY, annotation=int | None,
                      default=typer.Option(None, min=1, help="vLLM's max_num_seqs")),
    inspect.Parameter("gpu_memory_utilization", inspect.Parameter.KEYWORD_ONLY, annotation=float | None,
                      default=typer.Option(None, "--gpu-memory-utilization", "--gpu-mem",
                                           help="vLLM's gpu_memory_utilization")),
    inspect.Parameter("load_format", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                      default=typer.Option("auto", help="'dummy' for random weights from config.json")),
    inspect.Parameter("enforce_eager", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, help="no CUDA graphs, no torch.compile")),
    inspect.Parameter("engine_args", inspect.Parameter.KEYWORD_ONLY, annotation=str,
                      default=typer.Option("{}", help="any other vllm.LLM keyword arguments, as a JSON object "
                                           "(hf_overrides, additional_config, mamba_ssm_cache_dtype, ...)")),
]

_PROMPT_OPTIONS = [
    inspect.Parameter("prompts", inspect.Parameter.KEYWORD_ONLY, annotation=Path | None,
                      default=typer.Option(None, help="JSONL prompts: a 'prompt' text (tokenised with the target's "
                                           "tokenizer) or token ids ('prompt' or 'prompt_token_ids') per line")),
    inspect.Parameter("random_prompts", inspect.Parameter.KEYWORD_ONLY, annotation=bool,
                      default=typer.Option(False, help="random token-id prompts instead of --prompts")),
    inspect.Parameter("num_prompts", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                      default=typer.Option(24, min=1, help="how many prompts")),
    inspect.Parameter("prompt_len", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                      default=typer.Option(64, min=2, help="random prompts: longest prompt (shortest is half)")),
    inspect.Parameter("vocab", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                      default=typer.Option(1000, min=2, help="random prompts: token-id range")),
    inspect.Parameter("seed", inspect.Parameter.KEYWORD_ONLY, annotation=int,
                      default=typer.Option(0, min=0, help="random prompts: seed")),
]


def _grouped(fn, target: str, params: list[inspect.Parameter], build):
    """A command whose parameter ``target`` is built by ``build(**values)`` from the options
    ``params``, which typer sees in its place (so the options are declared once, here)."""
    sig = inspect.signature(fn)
    if target not in sig.parameters:
        raise TypeError(f"{fn.__name__} has no parameter {target!r}")
    names = [p.name for p in params]

    @functools.wraps(fn)
    def command(**kwargs):
        values = {n: kwargs.pop(n) for n in names}
        return fn(**{target: build(**values)}, **kwargs)

    others = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in sig.parameters.values() if p.name != target]
    command.__signature__ = sig.replace(parameters=[*others, *params])
    # some typer versions read the annotations rather than the signature
    command.__annotations__ = {p.name: p.annotation for p in command.__signature__.parameters.values()
                               if p.annotation is not inspect.Parameter.empty}
    return command


DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's ModelDType


def check_model(model: str) -> None:
    """``--model``: a hub id, or a local directory with a ``config.json`` (a path that looks local
    -- it exists, or starts with ``/``, ``.`` or ``~`` -- must be one)."""
    path = Path(model).expanduser()
    if not model.strip():
        raise typer.BadParameter("--model is empty; give a model directory or a hub id")
    if path.exists() or model.startswith(("/", ".", "~")):
        if not path.is_dir():
            raise typer.BadParameter(f"--model {model!r} {'is a file' if path.exists() else 'does not exist'}; "
                                     "expected a model directory (with config.json) or a hub id")
        if not (path / "config.json").is_file():
            raise typer.BadParameter(f"--model {model!r} has no config.json; expected a model directory or a hub id")


def check_engine_args(args: dict) -> None:
    """``--engine-args`` keys must be ``vllm.LLM`` keyword arguments (``EngineArgs`` fields), which
    are checked before vLLM starts; their values vLLM checks itself."""
    if not args:
        return
    import dataclasses

    from vllm import LLM
    from vllm.engine.arg_utils import EngineArgs

    valid = {f.name for f in dataclasses.fields(EngineArgs)} | set(inspect.signature(LLM.__init__).parameters)
    unknown = sorted(set(args) - valid)
    if unknown:
        from vllm_hybridspec.policy.errors import did_you_mean

        raise typer.BadParameter(f"--engine-args key {unknown[0]!r}{did_you_mean(unknown[0], sorted(valid))} is not "
                                 "a vllm.LLM keyword argument (vllm.engine.arg_utils.EngineArgs fields)")


def engine_options(fn):
    """Give ``fn``'s ``engine`` parameter the shared engine options (:class:`EngineOptions`)."""
    def build(engine_args: str, **values) -> EngineOptions:
        check_model(values["model"])
        if values["dtype"] not in DTYPES:
            raise typer.BadParameter(f"--dtype {values['dtype']!r} is not one of {', '.join(DTYPES)}")
        share = values["gpu_memory_utilization"]
        if share is not None and not (math.isfinite(share) and 0 < share <= 1):
            raise typer.BadParameter(f"--gpu-memory-utilization {share:g} is not valid; expected a share of the "
                                     "GPU's memory in (0, 1]")
        args = json_object(engine_args, "engine-args")
        check_engine_args(args)
        return EngineOptions(engine_args=args, **values)

    return _grouped(fn, "engine", _ENGINE_OPTIONS, build)


def prompt_options(fn):
    """Give ``fn``'s ``prompts`` parameter the shared prompt options (:class:`PromptOptions`)."""
    return _grouped(fn, "prompts", _PROMPT_OPTIONS, PromptOptions)


def option_names(options_class) -> list[str]:
    """The field names of :class:`EngineOptions` or :class:`PromptOptions` (for tests and docs)."""
    return [f.name for f in fields(options_class)]
