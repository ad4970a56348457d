"""Building the model: non-expert weights loaded as usual, experts left to the store.

The model is the standard transformers class for the checkpoint's family, created with
``experts_implementation="expertcache"`` (the engine's function registered in transformers'
``ExpertsInterface``). Parameters are created on the meta device, uninitialised (buffers such as
rotary tables are computed for real), the experts' fused parameters are dropped, and every other tensor
is read from the checkpoint into freshly allocated, aligned memory. No expert is read here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from expertcache.engine.dense import dense_linears
from expertcache.engine.families import FAMILIES, Family, family_of
from expertcache.engine.kernels import first_matrix
from expertcache.engine.memory import SlotLayout
from expertcache.engine.packed import CONFIG_KEY, Packed, PackedKernels, dense_name, dense_weight, from_config
from expertcache.engine.store import Checkpoint, ExpertStore
from expertcache.errors import ExpertcacheError, first_line
from expertcache.workers import usable_cpus

IMPLEMENTATION = "expertcache"
# threads reading the dense weights (one buffered read per tensor, ``Checkpoint.copy``), one a processor up
# to 4: measured on the 2-core development VM, fresh processes, page cache warm, 337 MiB of a
# Granite-shaped model: 0.21-0.23 s on one thread, 0.11-0.12 s on 2, 0.14 s on 4 (torch's copy out of
# the map: 0.11-0.12 s idle, 1.7-1.8 s beside other work, its threads waiting on each other)
DENSE_THREADS = min(4, usable_cpus())
_LAYER = re.compile(r"^(.*\blayers\.\d+)\.")


@dataclass
class Skeleton:
    model: torch.nn.Module
    config: object
    family: Family
    experts: list[torch.nn.Module]  # the Experts module of each MoE layer, in layer order
    store: ExpertStore
    num_experts: int
    top_k: int
    shapes: dict[str, tuple[int, ...]]  # one expert's tensors at full precision (slot tensor name -> shape)
    dtype: torch.dtype
    packed: Packed | None = None  # a packed checkpoint's experts (``engine.packed``); None: as ``shapes``

    @property
    def layout(self) -> SlotLayout:
        """One whole expert's slot, as the checkpoint stores it."""
        return self.packed.layout() if self.packed is not None else SlotLayout.of(self.shapes, self.dtype)


TOP_K_NAMES = ("num_experts_per_tok", "top_k", "top_k_experts", "moe_topk")  # what families call it
_EXPERTS_NAMES = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def config_top_k(config) -> int:
    """The experts a token is routed to, as the config names it (0: not found)."""
    return next((int(v) for a in TOP_K_NAMES if (v := getattr(config, a, 0))), 0)


def _check_routing(config, cfg_file: Path) -> None:
    """One line for a config that routes each token to more experts than a layer has (top-k 99 of 8 was
    refused later as a budget no setting could meet, or crashed transformers)."""
    top = next(
        ((a, v) for a in TOP_K_NAMES if isinstance(v := getattr(config, a, None), int) and v > 0), None
    )
    count = next(
        ((a, v) for a in _EXPERTS_NAMES if isinstance(v := getattr(config, a, None), int) and v > 0), None
    )
    if top is not None and count is not None and top[1] > count[1]:
        raise ExpertcacheError(
            f"{cfg_file}: {top[0]} {top[1]} routes each token to more experts than a layer has "
            f"({count[0]} {count[1]})"
        )


def read_config(path: str | Path):
    """The checkpoint's transformers config, with one-line errors for a missing or broken one; for an
    image-text checkpoint whose text model is a supported family, the text model's config (with the
    checkpoint's dtype and packing, kept at its top level)."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_dir():
        what = "a file, not a checkpoint directory" if path.exists() else "no such checkpoint directory"
        raise ExpertcacheError(f"{path}: {what}")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ExpertcacheError(f"{path}: no config.json (not a Hugging Face checkpoint)")
    try:
        raw = json.loads(cfg_file.read_text(encoding="utf-8-sig"))
    except (OSError, ValueError) as exc:
        raise ExpertcacheError(f"{cfg_file}: not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise ExpertcacheError(f"{cfg_file}: a config is a JSON object, got {type(raw).__name__}")
    if "model_type" not in raw:  # "unsupported architecture 'None'" named no problem
        raise ExpertcacheError(f"{cfg_file}: no model_type (the architecture's name, e.g. mixtral)")
    model_type = str(raw.get("model_type"))
    if model_type not in FAMILIES and not (
        isinstance(raw, dict) and isinstance(raw.get("text_config"), dict)
    ):
        family_of(model_type)  # one line listing the supported families
    if cfg_file.read_bytes().startswith(b"\xef\xbb\xbf"):  # transformers reads it as broken JSON
        raise ExpertcacheError(
            f"{cfg_file}: starts with a byte-order mark, which transformers does not read: save it without"
        )
    try:
        config = AutoConfig.from_pretrained(str(path))
    except Exception as exc:
        raise ExpertcacheError(f"{cfg_file}: cannot build the config ({first_line(exc)})") from None
    if model_type in FAMILIES:
        _check_routing(config, cfg_file)
        return config
    text = config.get_text_config()  # an image-text checkpoint: its text model is what the engine runs
    # the class's own type: a config.json's text_config can name another one, which the class keeps
    text_type = str(getattr(type(text), "model_type", None) or getattr(text, "model_type", None))
    if text is config or text_type not in FAMILIES:
        try:
            family_of(text_type)
        except ExpertcacheError as exc:
            raise ExpertcacheError(f"{model_type}: its text model: {exc}") from None
    text.model_type = text_type  # what it is built as, whatever config.json's text_config names
    _check_routing(text, cfg_file)
    if getattr(text, "dtype", None) is None:
        text.dtype = getattr(config, "dtype", None)
    for name in ("quantization_config", CONFIG_KEY):  # the checkpoint's packing, kept at the top level
        if getattr(config, name, None) is not None and getattr(text, name, None) is None:
            setattr(text, name, getattr(config, name))
    # the image-text class ties its output head to the embeddings as its own config says (Qwen3-VL-MoE's
    # text config defaults to tied, the image-text config to untied)
    if getattr(config, "tie_word_embeddings", None) is not None:
        text.tie_word_embeddings = config.tie_word_embeddings
    from transformers import AutoModelForImageTextToText

    mapping = AutoModelForImageTextToText._model_mapping
    if type(config) in mapping and not getattr(mapping[type(config)], "_tied_weights_keys", None):
        text.tie_word_embeddings = False  # a class that ties nothing (Muse Spark's), whatever the configs say
    return text


# where image-text checkpoints keep their text model: the checkpoint's name for ``model.`` -> the prefix
# of the text model's other keys (its lm_head): transformers 5's layout (Qwen3.5-MoE's, Gemma 4's). A
# layout is added here with a checkpoint that uses it (MiniMax-M3-VL's ``language_model.model.`` is not:
# transformers 5.24's image-text class of it saves no shared experts, which its text class has)
COMPOSITE_ROOTS = {"model.language_model.": "", "model.": ""}  # the second: Hy-V4-VL's (vision under vit.)


def checkpoint_family(path: str | Path, config) -> Family:
    """The family of ``config`` (``read_config``'s), with transformers' root for an image-text checkpoint
    (``config`` is its text model's; the checkpoint's own root is found by ``fit_layout``)."""
    family = family_of(config.model_type)
    try:
        outer = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        outer = config.model_type
    if outer != config.model_type:
        root = next(iter(COMPOSITE_ROOTS))
        family = dataclasses.replace(family, root=root, outer=COMPOSITE_ROOTS[root])
    return family


def fit_layout(family: Family, ckpt: Checkpoint, prefix: str) -> Family:
    """The record as the checkpoint stores it: its own layout of the experts or one of its ``layouts``,
    under its root or an image-text checkpoint's (``COMPOSITE_ROOTS``); the first whose first expert of the
    layer at ``prefix`` the checkpoint holds. None fits: the record as it is (its missing tensors are then
    named by the expert store's check)."""
    # (a text model saved from an image-text one keeps its image-text names: transformers reads those too)
    roots = [(family.root, family.outer)] + [(r, o) for r, o in COMPOSITE_ROOTS.items() if r != family.root]
    for root, outer in roots:
        for variant in family.variants():
            fit = dataclasses.replace(variant, root=root, outer=outer)
            keys = fit.expert_keys(prefix, 0)
            if all(k in ckpt for ks in keys.values() for k, _ in ks):
                return fit
    return family


def resolve_dtype(dtype, config) -> torch.dtype:
    if dtype is None or dtype == "auto":
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    given = dtype
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype.removeprefix("torch."), None)
    if dtype not in COMPUTE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in COMPUTE_DTYPES)
        raise ExpertcacheError(f"dtype {given!r} is not a compute dtype the engine runs in ({names})")
    return dtype


# what transformers' modules compute in (float8 and the like are storage formats: packed experts)
COMPUTE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


_NARROW = (torch.bfloat16, torch.float16)  # dense weights kept as stored until quantised (``build_skeleton``)
# transformers' attention implementations the engine runs; the last is sdpa without cuDNN's backend
# (engine.attention), registered with transformers when it is asked for
ATTENTION = ("sdpa", "eager", "sdpa_no_cudnn")


def check_attention(attention: str | None) -> str | None:
    """``attention`` if it is one of ``ATTENTION`` (or None: transformers' default); else one clear line."""
    if attention == "sdpa_no_cudnn":
        from expertcache.engine.attention import register

        return register()
    if attention is None or attention in ATTENTION:
        return attention
    raise ExpertcacheError(
        f"attention {attention!r} (attention, --attention) is not one the engine runs: {', '.join(ATTENTION)}"
    )


def default_attention(model: torch.nn.Module, attention: str | None, device) -> None:
    """The engine's default attention on ``device``, set on ``model`` (the engine's or its reference's
    alike): transformers' default, except on a GPU where that default is ``sdpa``: ``sdpa_no_cudnn``
    (``engine.attention``). cuDNN's attention, which torch prefers on Hopper for heads without grouping,
    plans every new key length, and every decode step has one: on an H200 a server at 16 clients made 14.6
    tokens a second with it on a machine just started, 247 without it (docs/BENCHMARKS.md). An
    ``attention`` asked for is left as asked (``sdpa``: transformers' own, cuDNN allowed)."""
    if attention is not None or device is None or torch.device(device).type != "cuda":
        return
    if getattr(model.config, "_attn_implementation", None) == "sdpa":
        model.set_attn_implementation(check_attention("sdpa_no_cudnn"))


def build_skeleton(
    path: str | Path,
    dtype=None,
    progress: bool = False,
    attention: str | None = None,
    quantized_dense: bool = False,
    device=None,
) -> Skeleton:
    """The model with non-expert weights loaded (on CPU) and an expert store for the rest; its attention in
    transformers' implementation ``attention`` (``ATTENTION``; None: transformers' default, or on a GPU
    ``default_attention``'s, for a ``device`` the engine will run on).
    ``quantized_dense``: the dense layers will be quantised next (``engine.dense``), so their weights are
    read as stored where that is narrower than ``dtype`` (a bfloat16 checkpoint run in float32 does not
    hold every dense weight in float32 at once for the moment before it is quantised)."""
    from accelerate import init_empty_weights
    from transformers.initialization import no_init_weights

    import expertcache.engine.runtime  # noqa: F401  (registers the experts implementation)
    from expertcache.engine.causal import causal_lm_class

    config = read_config(path)
    family = checkpoint_family(path, config)
    dtype = resolve_dtype(dtype, config)
    ckpt = Checkpoint(path)
    # parameters on the meta device and no initialisation of them (random draws into meta tensors took 0.3 s
    # of a Granite-shaped model's load): every one is read from the checkpoint; buffers are computed
    with init_empty_weights(include_buffers=False), no_init_weights(), _attention_refused(config, attention):
        try:
            model = causal_lm_class(config).from_config(
                config, experts_implementation=IMPLEMENTATION, dtype=dtype, **_attention_kwargs(attention)
            )
        except (RuntimeError, ValueError, TypeError) as exc:  # a size of -16, a head of 9 values in 2 ...
            if attention is not None and "attention" in str(exc).lower():
                raise  # _attention_refused's to say
            raise ExpertcacheError(f"{path}: transformers cannot build the model config.json describes "
                                   f"({first_line(exc)})") from None  # fmt: skip
    default_attention(model, attention, device)
    experts, prefixes, shapes = [], [], None
    for name, module in model.named_modules():
        if not _is_experts(module):
            continue
        m = _LAYER.match(name + ".")
        if m is None:
            raise ExpertcacheError(f"cannot tell the decoder layer of experts module {name}")
        own = {n: tuple(p.shape[1:]) for n, p in module.named_parameters(recurse=False)}
        if set(own) != set(family.sources):
            raise ExpertcacheError(
                f"{config.model_type}: experts module has tensors {sorted(own)}, "
                f"expected {sorted(family.sources)}"
            )
        if shapes is not None and own != shapes:
            raise ExpertcacheError(
                f"{config.model_type}: MoE layers with different expert shapes are unsupported"
            )
        shapes = own
        num_experts = int(module.num_experts)
        for n in own:
            delattr(module, n)
        experts.append(module)
        prefixes.append(m.group(1))
    if not experts:
        raise ExpertcacheError(f"{path}: the model has no routed experts")
    shapes = {n: shapes[n] for n in family.sources}  # family order: gate_up first
    family = fit_layout(family, ckpt, prefixes[0])
    first = family.expert_keys(prefixes[0], 0)

    def stored_dtype(name: str, suffix: str = ""):
        key = first[name][0][0] + suffix
        if key not in ckpt:  # the checkpoint named once, by the message below that wraps this one
            raise ExpertcacheError(f"checkpoint lacks expert tensor {key}")
        return ckpt.dtype(key)

    try:
        packed = from_config(config, family, shapes, dtype, bool(experts[0].is_transposed), stored_dtype)
    except ExpertcacheError as exc:
        from expertcache.engine.hub import model_label

        raise ExpertcacheError(f"{model_label(Path(path))}: {exc}") from None
    if packed is None:
        store = ExpertStore(ckpt, family, prefixes, shapes, num_experts)
    else:
        store = ExpertStore(ckpt, family, prefixes, packed.tensors(), num_experts, packed=packed)
        kernels = PackedKernels(packed)
        for module in experts:
            module._expertcache_packed = kernels  # ``parts.expert_output`` computes it from packed bytes
    stored = set()  # read as stored: the layers about to be quantised, not a head tied to the embeddings
    if quantized_dense:
        tied = model.get_output_embeddings() if getattr(config, "tie_word_embeddings", False) else None
        stored = {f"{name}.weight" for name, m in dense_linears(model) if m is not tied}
    _load_dense(model, ckpt, family, store.expert_keys(), dtype, progress, packed, stored)
    top_k = config_top_k(config)
    model.eval()
    return Skeleton(model, config, family, experts, store, num_experts, top_k, shapes, dtype, packed)


def _swap_suffix(name: str, old: str, new: str) -> str | None:
    """``name`` with its dotted suffix ``old`` replaced by ``new``; None if it does not end so."""
    if name == old:
        return new
    if name.endswith("." + old):
        return name[: -len(old)] + new
    return None


def _is_experts(module: torch.nn.Module) -> bool:
    """A transformers ``...Experts`` module (decorated with ``use_experts_implementation``)."""
    return hasattr(module, "has_gate") and isinstance(
        getattr(module, first_matrix(module), None), torch.Tensor
    )


def _load_dense(
    model: torch.nn.Module,
    ckpt: Checkpoint,
    family: Family,
    skip: set[str],
    dtype,
    progress: bool = False,
    packed: Packed | None = None,
    stored: set[str] = frozenset(),
) -> None:
    """Every non-expert tensor from the checkpoint, read into fresh aligned memory (``Checkpoint.copy``,
    on ``DENSE_THREADS`` threads), in ``dtype``; another tool's quantised weights dequantised as transformers
    does on a CPU (``packed.dense_weight``). The parameters named in ``stored`` stay in a narrower float
    dtype they are stored in (16-bit), to be quantised next."""
    # each tensor's dtype in the model: ``dtype``, but float32 for what the class keeps so (DeepSeek-V3's
    # router: ``_keep_in_fp32_modules_strict``), as transformers loads it
    expected = {name: t.dtype for name, t in model.state_dict().items()}
    expected_shape = {name: t.shape for name, t in model.state_dict().items()}
    names = {}  # checkpoint key -> parameter name; the rest (rotary tables of old checkpoints) is dropped
    joins: dict[str, list[str | None]] = {}  # parameter stored in pieces -> its pieces' checkpoint keys
    splits: dict[str, list[str]] = {}  # checkpoint key stored whole -> the parameters it is cut into
    for key in ckpt:
        if key in skip:
            continue
        name = family.rename(dense_name(packed, key))  # compressed-tensors' X.weight_packed: X.weight
        if name in expected:
            names[key] = name
            continue
        for pc in family.pieces:
            if pc.stored == "pieces":
                for i, piece in enumerate(pc.pieces):
                    whole = _swap_suffix(name, piece, pc.whole)
                    if whole in expected:
                        joins.setdefault(whole, [None] * len(pc.pieces))[i] = key
            elif (parts := [_swap_suffix(name, pc.whole, piece) for piece in pc.pieces]) and all(
                part in expected for part in parts
            ):
                splits[key] = parts
    joins = {whole: keys for whole, keys in joins.items() if None not in keys}  # else: reported lacking
    # each key read, and a parameter of it (whose dtype it is read in)
    owner = {**names, **{k: w for w, ks in joins.items() for k in ks}}
    owner.update({k: parts[0] for k, parts in splits.items()})
    keys = list(owner)
    for key in keys:
        ckpt.tensor(key)  # every file mapped once, here: the copies run on several threads
    state = {}
    with ThreadPoolExecutor(max(1, min(DENSE_THREADS, len(keys)))) as pool:
        copies = pool.map(ckpt.copy, keys)
        if progress:
            from tqdm.auto import tqdm

            copies = tqdm(copies, total=len(keys), desc="dense weights", unit="tensor", leave=False)
        read = {}
        for key, t in zip(keys, copies, strict=True):
            want = expected[owner[key]] if expected[owner[key]].is_floating_point else dtype
            raw = t.dtype
            t = dense_weight(packed, ckpt, key, t, want)
            if owner[key] in stored and t.dtype == raw and raw in _NARROW and raw.itemsize < want.itemsize:
                want = raw  # as stored: quantised next, to the same values (``dense.compute_dtype``)
            read[key] = t.to(dtype=want) if t.is_floating_point() else t
    for key, name in names.items():
        state[name] = read[key]
    for whole, pieces in joins.items():
        state[whole] = torch.cat([read[k] for k in pieces])
    for key, parts in splits.items():
        sizes = [expected_shape[p][0] for p in parts]
        if sum(sizes) != read[key].shape[0]:
            rows = read[key].shape[0]
            raise ExpertcacheError(
                f"{ckpt.path}: {key} has {rows} rows, not the {sum(sizes)} of {', '.join(parts)}"
            )
        for part, t in zip(parts, torch.split(read[key], sizes), strict=True):
            state[part] = t.clone()
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as exc:  # "size mismatch for ...": config.json describes another model's shapes
        found = re.search(r"size mismatch for (\S+): copying a param with shape torch.Size\((\[[^\]]*\])\) "
                          r"from checkpoint, the shape in current model is torch.Size\((\[[^\]]*\])\)",
                          str(exc))  # fmt: skip
        said = (f"{found[1]} is {found[2]} in the weights, {found[3]} by config.json" if found
                else first_line(exc))  # fmt: skip
        raise ExpertcacheError(f"{ckpt.path}: config.json does not describe these weights: {said}") from None
    model.tie_weights()
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise ExpertcacheError(f"{ckpt.path}: checkpoint lacks tensor {name}")


def layers_beyond(ckpt: Checkpoint, config) -> str:
    """Decoder layers the checkpoint's tensors name past the config's ``num_hidden_layers`` (as text:
    "3..5"), or "" where there are none."""
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int):
        return ""
    found = sorted({int(m[1]) for key in ckpt for m in [_LAYER_KEY.match(key)] if m and int(m[1]) >= count})
    if not found:
        return ""
    return str(found[0]) if len(found) == 1 else f"{found[0]}..{found[-1]}"


# the decoder's layers (not a vision tower's: model.vision_model.layers.N may outnumber the text's)
_LAYER_KEY = re.compile(r"(?:model\.)?(?:language_model\.)?(?:model\.)?layers\.(\d+)\.")


@contextlib.contextmanager
def _attention_refused(config, attention: str | None):
    """transformers' refusal of an attention implementation its class lacks (GPT-OSS has no ``sdpa``), as
    one line."""
    try:
        yield
    except ValueError as exc:
        if attention is None or "attention" not in str(exc).lower():
            raise
        raise ExpertcacheError(
            f"{config.model_type}: transformers runs no {attention} attention for this family (--attention "
            "eager, or leave it out for transformers' default)"
        ) from None


def _attention_kwargs(attention: str | None) -> dict[str, str]:
    return {} if check_attention(attention) is None else {"attn_implementation": attention}


# packings transformers computes with its own kernels where a GPU is present and dequantises where not: the
# reference dequantises them everywhere (what the engine is exact against), on a GPU machine too
DEQUANTIZED = ("fp8", "mxfp4")


def _dequantized(config) -> dict[str, object]:
    """``from_pretrained``'s ``quantization_config`` for a checkpoint packed in ``DEQUANTIZED``: its own,
    dequantising at load; none for others."""
    packing = getattr(config, "quantization_config", None)
    packing = packing.to_dict() if hasattr(packing, "to_dict") else packing
    if not isinstance(packing, dict) or packing.get("quant_method") not in DEQUANTIZED:
        return {}
    from transformers.quantizers.auto import AutoQuantizationConfig

    own = AutoQuantizationConfig.from_dict(dict(packing))
    own.dequantize = True
    return {"quantization_config": own}


def in_dtype(experts: str, dtype: torch.dtype) -> str:
    """transformers' experts implementation ``experts`` where it computes in ``dtype``, else eager (torch's
    ``_grouped_mm`` takes no float64; the engine's kernels do)."""
    return "eager" if experts == "grouped_mm" and dtype == torch.float64 else experts


def default_reference(device, dtype: torch.dtype) -> str:
    """transformers' experts implementation the engine's default kernel on ``device`` is exact against
    (``engine.kernels``), in ``dtype`` (``in_dtype``)."""
    from expertcache.engine.kernels import default_kernel

    return in_dtype(default_kernel(device).reference, dtype)


def load_reference(
    path: str | Path,
    dtype=None,
    device: str = "cpu",
    experts: str | None = None,
    attention: str | None = None,
) -> torch.nn.Module:
    """The same model run by transformers with every weight resident, its experts computed by transformers'
    ``experts`` implementation (``"eager"``, ``"grouped_mm"``, ``"batched_mm"``); by default the one the
    engine's default kernel on ``device`` is exact against (``engine.kernels``: ``grouped_mm`` where
    torch has it). ``attention``: transformers' attention implementation (``ATTENTION``; None: its
    default, ``default_attention``'s on a GPU), as the engine's ``load(attention=...)``.

    Every tensor is cloned into fresh memory, as the engine's slots and dense weights are, so that
    both see the same alignment (weights read in place from a memory map can round differently).
    """
    from transformers import AutoConfig

    from expertcache.engine.causal import reference_class

    config = read_config(path)
    dtype = resolve_dtype(dtype, config)
    chosen = experts
    if experts is None:
        experts = default_reference(device, dtype)
    if experts == "grouped_mm" and dtype == torch.float64:
        raise ExpertcacheError("transformers' grouped_mm experts do not compute in float64: use eager")
    cls = reference_class(AutoConfig.from_pretrained(str(path)))
    Checkpoint(path)  # its files' headers: a truncated or corrupt one in one line, as the engine says it
    try:
        with _attention_refused(config, attention):  # an attention the family lacks: its own line first
            model = cls.from_pretrained(
                str(path), experts_implementation=experts, dtype=dtype, **_attention_kwargs(attention),
                **_dequantized(config),
            )  # fmt: skip
    except ExpertcacheError:
        raise
    except Exception as exc:  # transformers' own errors, a traceback deep in its loading
        why = first_line(exc)
        if "ignore_mismatched_sizes" in why:  # its report of the tensors is logged, not in the error
            why = "a weight is missing from the checkpoint, or of another shape than config.json gives"
        raise ExpertcacheError(f"{path}: transformers cannot load this checkpoint ({why})") from None
    default_attention(model, attention, device)
    if chosen is None:
        from expertcache.engine.kernels import not_grouped

        if any(hasattr(m, "_apply_gate") and not_grouped(m) for m in model.modules()):
            model.set_experts_implementation("eager")  # the engine's kernel for these (``resolve_kernel``)
    with torch.no_grad():
        for p in model.parameters():
            p.data = p.data.clone()
    return model.to(device).eval()
