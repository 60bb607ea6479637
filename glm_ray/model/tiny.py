"""`glm-ray make-tiny`: a small random GLM-5 checkpoint in the real on-disk format.

What gets written (all of it loadable by transformers' `GlmMoeDsaForCausalLM` too):
  config.json                   glm_moe_dsa config (default: configs/glm5-tiny.json: index_topk 8,
                                IndexShare "FFSF", grouped routing n_group 2, 1 MTP layer)
  model-0000N-of-0000M.safetensors + model.safetensors.index.json   per-expert tensor names, bf16
                                weights, fp32 e_score_correction_bias, MTP layer under model.layers.L
  tokenizer.json / tokenizer_config.json   a byte-level BPE trained in-process, GLM's special tokens,
                                its thinking / tool-call markup as single (non-special) tokens, and a
                                chat template rendering GLM-5's format (CHAT_TEMPLATE: tools, tool
                                calls and results, thinking, enable_thinking)
Norm weights, the indexer k_norm and the router bias are perturbed so those code paths matter.
A GLM-5.3-Flash text config (`--config glm53-flash-tiny-text.json`) is written as the nested glm5_next
config.json of a real checkpoint (`text_config`), with its tensors under `model.language_model.*`
(no vision tower).
"""
from __future__ import annotations

import collections
import fcntl
import functools
import hashlib
import itertools
import json
import logging
import os
import pathlib
import string
import textwrap
from importlib import resources
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from glm_ray import envs
from glm_ray.config import ModelConfig
from glm_ray.model import MODEL_CLASSES
from glm_ray.model.loader import init_dummy_weights
from glm_ray.quant import Unquantized

logger = logging.getLogger(__name__)

# Control tokens (special: skipped when decoding with skip_special_tokens) and the markup tokens of
# thinking and tool calls, added but *not* special (the real GLM tokenizers mark them so: `<think>` and
# `<tool_call>` survive skip_special_tokens, so the reasoning / tool-call parsers see them). Ids in this
# order from 0: ids 0-8 are those of the first tiny tokenizer.
SPECIAL_TOKENS = ["[gMASK]", "<|endoftext|>", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                  "<|observation|>"]
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                 "</arg_value>", "<tool_response>", "</tool_response>"]
EOS_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]      # ids 1, 4, 6 (GLM's stop set)

# The GLM-5 chat format (GLM-4.7's template family; our own template written to render exactly what the
# released one does; a real checkpoint's template is always used as shipped):
#   [gMASK]<sop>                                        then, when `tools` are given, one system turn:
#   <|system|>\n# Tools\n\n...<tools>\n{tool JSON}\n...</tools>\n\n...format...</tool_call>
#   <|system|>S  <|user|>U                              no newline after a role token
#   <|assistant|></think>C                              a past turn: reasoning dropped ...
#   <|assistant|><think>R</think>C                      ... unless after the last user turn (or clear_thinking=false)
#   <tool_call>NAME<arg_key>K</arg_key><arg_value>V</arg_value>...</tool_call>   per call; V raw if a string,
#                                                                                else JSON
#   <|observation|><tool_response>T</tool_response>...  consecutive tool results share one <|observation|>
#   <|assistant|><think>   generation prompt (thinking on, the default; the output starts inside the
#   <|assistant|></think>  thinking block) / with chat_template_kwargs {"enable_thinking": false}
_TOOLS_HEADER = (r"<|system|>\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                 r"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n")
_TOOLS_FOOTER = (r"</tools>\n\nFor each function call, output the function name and arguments within the "
                 r"following XML format:\n<tool_call>{function-name}<arg_key>{arg-key-1}</arg_key><arg_value>"
                 r"{arg-value-1}</arg_value><arg_key>{arg-key-2}</arg_key><arg_value>{arg-value-2}</arg_value>"
                 r"...</tool_call>")
CHAT_TEMPLATE = (
    "[gMASK]<sop>"
    "{%- macro visible(c) -%}"
    "{%- if c is string -%}{{- c -}}"
    "{%- elif c is iterable and c is not mapping -%}"
    "{%- for p in c -%}{%- if p is mapping and p.type == 'text' -%}{{- p.text -}}"
    "{%- elif p is string -%}{{- p -}}{%- endif -%}{%- endfor -%}"
    "{%- elif c is not none -%}{{- c -}}"
    "{%- endif -%}"
    "{%- endmacro -%}"
    "{%- if tools -%}"
    "{{- '" + _TOOLS_HEADER + "' -}}"
    "{%- for tool in tools -%}{{- tool | tojson(ensure_ascii=False) -}}{{- '\\n' -}}{%- endfor -%}"
    "{{- '" + _TOOLS_FOOTER + "' -}}"
    "{%- endif -%}"
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m.role == 'system' or m.role == 'developer' -%}{{- '<|system|>' + visible(m.content) -}}"
    "{%- elif m.role == 'user' -%}{{- '<|user|>' + visible(m.content) -}}"
    "{%- elif m.role == 'assistant' -%}"
    "{%- set content = visible(m.content) -%}"
    "{%- set reasoning = '' -%}"
    "{%- if m.reasoning_content is string -%}{%- set reasoning = m.reasoning_content -%}"
    "{%- elif '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].split('<think>')[-1] -%}"
    "{%- set content = content.split('</think>')[-1] -%}"
    "{%- endif -%}"
    "{{- '<|assistant|>' -}}"
    "{%- if reasoning.strip() and (loop.index0 > ns.last_user or (clear_thinking is defined and not clear_thinking)) -%}"
    "{{- '<think>' + reasoning.strip() + '</think>' -}}"
    "{%- else -%}{{- '</think>' -}}{%- endif -%}"
    "{{- content.strip() -}}"
    "{%- for tc in m.tool_calls or [] -%}"
    "{%- set f = tc.function if tc.function is defined else tc -%}"
    "{{- '<tool_call>' + f.name -}}"
    "{%- for k, v in (f.arguments or {}).items() -%}"
    "{{- '<arg_key>' + k + '</arg_key><arg_value>' -}}"
    "{{- v if v is string else v | tojson(ensure_ascii=False) -}}"
    "{{- '</arg_value>' -}}"
    "{%- endfor -%}"
    "{{- '</tool_call>' -}}"
    "{%- endfor -%}"
    "{%- elif m.role == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' -%}{{- '<|observation|>' -}}{%- endif -%}"
    "{{- '<tool_response>' + visible(m.content) + '</tool_response>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|assistant|>' + ('</think>' if (enable_thinking is defined and not enable_thinking) else '<think>') -}}"
    "{%- endif -%}"
)
def bundled_config(name: str = "glm5-tiny.json") -> dict:
    return json.loads(resources.files("glm_ray.configs").joinpath(name).read_text())


def _corpus() -> list[str]:
    """Plain English + code text available offline: docstrings of a fixed set of stdlib modules."""
    lines = []
    for mod in (collections, functools, itertools, json, pathlib, string, textwrap):
        for obj in [mod, *vars(mod).values()]:
            doc = getattr(obj, "__doc__", None)
            if isinstance(doc, str):
                lines += [l.strip() for l in doc.splitlines() if l.strip()]
    lines += ["Hello! How can I help you today?", "The quick brown fox jumps over the lazy dog.",
              "1 2 3 4 5 6 7 8 9 10", "你好，世界", "def main():\n    return 0"]
    return lines


def build_tokenizer(vocab_size: int):
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415 - heavy; the `glm-ray` CLI imports tiny.py
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS + MARKUP_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_corpus(), trainer)
    spec = json.loads(tok.to_str())        # the trainer adds every reserved token as special: unmark the markup
    for added in spec["added_tokens"]:
        if added["content"] in MARKUP_TOKENS:
            added["special"] = False
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=[t for t in SPECIAL_TOKENS if t != "<|endoftext|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


@torch.no_grad()
def write_tiny(out_dir: str | os.PathLike, config: dict | None = None, seed: int = 0, num_shards: int = 2,
               dtype: torch.dtype = torch.bfloat16) -> Path:

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hf = dict(config or bundled_config())
    flash = hf.get("model_type") in ("glm5_next", "glm5_next_text")
    text = dict(hf.get("text_config") or hf) if flash else hf
    if not flash:
        # NOTE: "layer_types" is derived by transformers; older releases (5.17) reject the value newer ones
        # write ("indexed_attention"), and real GLM-5 config.json files do not carry it.
        hf.pop("layer_types", None)
    tokenizer = build_tokenizer(text["vocab_size"])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS + MARKUP_TOKENS}
    text.update(eos_token_id=[ids[t] for t in EOS_TOKENS], bos_token_id=ids["[gMASK]"],
                pad_token_id=ids["<|endoftext|>"], dtype=str(dtype).removeprefix("torch."))
    if flash:
        text.pop("architectures", None)
        text["model_type"] = "glm5_next_text"
        hf = {"architectures": ["Glm5NextForConditionalGeneration"], "model_type": "glm5_next",
              "text_config": text, "tie_word_embeddings": False, "dtype": text["dtype"],
              "eos_token_id": text["eos_token_id"], "pad_token_id": text["pad_token_id"]}
    cfg = ModelConfig.from_hf(hf, dtype="float32")
    model = MODEL_CLASSES[cfg.architecture](cfg, Unquantized(), torch.float32)
    init_dummy_weights(model, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():          # perturb what random init leaves degenerate
        if getattr(p, "is_norm", False):
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("k_norm.bias") or name.endswith("e_score_correction_bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif name == "lm_head.weight":
            p.mul_(4.0)   # sharper next-token distributions: greedy parity is not decided by 1e-6 gaps

    tensors = {}
    for ckpt_name, (p, _, kw) in model.checkpoint_params().items():
        t = _export(p, kw)
        keep_fp32 = ckpt_name.endswith(_FP32_TENSORS)
        tensors[ckpt_name] = t.to(torch.float32 if keep_fp32 else dtype).contiguous()
    names = sorted(tensors)
    per = -(-len(names) // num_shards)
    weight_map = {}
    total = 0
    for i in range(num_shards):
        fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
        chunk = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
        save_file(chunk, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in chunk})
        total += sum(t.numel() * t.element_size() for t in chunk.values())
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(out / "config.json", "w") as f:
        json.dump(hf, f, indent=2)
    with open(out / "generation_config.json", "w") as f:
        json.dump({"eos_token_id": text["eos_token_id"], "pad_token_id": text["pad_token_id"]}, f, indent=2)
    tokenizer.save_pretrained(str(out))
    tc_path = out / "tokenizer_config.json"      # portable across transformers 5.x releases
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc_path.write_text(json.dumps(tc, indent=2))
    logger.info("wrote tiny checkpoint to %s (%d tensors)", out, len(tensors))
    return out


# stored fp32 in real checkpoints whatever the weight dtype (GLM-5.3-Flash: KDA conv/decay, mHC mixing)
_FP32_TENSORS = ("e_score_correction_bias", "conv1d.weight", "dt_bias", "A_log", "hc_attn_base", "hc_attn_scale",
                 "hc_ffn_base", "hc_ffn_scale")


def _export(p: torch.Tensor, kw: dict) -> torch.Tensor:
    """Inverse of the weight loaders at TP=1: the checkpoint tensor for one (param, shard)."""
    sid, e = kw.get("shard_id"), kw.get("expert_id")
    if e is not None:
        w = p.data[e]
        return w if sid == "w2" else w.chunk(2, dim=0)[0 if sid == "w1" else 1]
    if sid is not None:                                          # merged linears: shard sid of its units
        return p.data.split(p.shard_units, dim=p.output_dim)[sid]
    return p.data


def cache_dir() -> Path:
    return envs.CACHE.get()


def tiny_cache_key() -> str:
    """Part of the cached tiny checkpoint's directory name: a change of the tokens, the chat template or the
    bundled config writes a new cache instead of reusing one in the old format."""
    spec = [SPECIAL_TOKENS, MARKUP_TOKENS, CHAT_TEMPLATE, bundled_config()]
    return hashlib.sha1(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:8]


def default_tiny_model() -> str:
    """Path of the cached tiny model, written on first use (safe against concurrent callers)."""
    path = cache_dir() / f"tiny-glm5-{tiny_cache_key()}"
    if (path / "config.json").is_file():
        return str(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / ".tiny.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (path / "config.json").is_file():
            tmp = path.with_name(path.name + f".tmp{os.getpid()}")
            write_tiny(tmp)
            tmp.rename(path)
    return str(path)


def resolve_model(model: str | None) -> str:
    """A model argument -> an HF-style directory.

    None / "tiny" -> the cached tiny checkpoint; an existing directory -> itself; a config.json file or
    the name of a bundled config (e.g. "glm5-flash-31b") -> a cached directory holding just that
    config.json (for `--load-format dummy`: full-size shapes without a checkpoint).
    """
    if model in (None, "tiny"):
        return default_tiny_model()
    p = Path(model)
    if p.is_dir():
        return str(p)
    if p.is_file() and p.suffix == ".json":
        text, stem = p.read_text(), p.stem
    else:
        name = model if model.endswith(".json") else model + ".json"
        try:
            text, stem = resources.files("glm_ray.configs").joinpath(name).read_text(), Path(name).stem
        except (FileNotFoundError, OSError):
            raise FileNotFoundError(f"model {model!r}: not a directory, a config.json, or a bundled config "
                                    f"({', '.join(sorted(n.name for n in resources.files('glm_ray.configs').iterdir() if n.name.endswith('.json')))})") from None
    d = cache_dir() / "configs" / f"{stem}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"
    d.mkdir(parents=True, exist_ok=True)
    if not (d / "config.json").is_file():
        (d / "config.json").write_text(text)
    return str(d)
