"""Chapter 04's KV-cache size calculator: a model's attention shape, a context length, a batch and a
number format in, the cache's bytes per scheme (MHA, GQA, MQA, MLA) out.

The widget is a thin shell over ``kv_cache_table_html``, which unit tests call directly; number
boxes refuse out-of-range values with a message (``widgets.whole_number``) instead of clamping them.
"""

from __future__ import annotations

from ar_lab.base.errors import BadValue
from ar_lab.course.views.widgets import refuse, whole_number


def kv_cache_table_html(
    shape, seq_len: int, batch_size: int, dtype: str
) -> tuple[dict[str, int], str]:
    """Cache bytes per scheme for ``shape`` (an ``AttentionShape``) and an HTML table of them.

    Pure apart from formatting: the numbers come from ``ar_lab.perf.kv_sizing.cache_sizes``.
    """
    import html

    from ar_lab.perf.kv_sizing import BYTES_PER_VALUE, cache_sizes, format_bytes

    if dtype not in BYTES_PER_VALUE:
        raise BadValue(
            f"dtype must be one of {sorted(BYTES_PER_VALUE)}, got {dtype!r}", arg="dtype"
        )
    nbytes = BYTES_PER_VALUE[dtype]
    sizes = cache_sizes(shape, seq_len, batch_size, nbytes)
    per_layer_values = {  # what one token stores in one layer, in values
        "MHA": f"2 × {shape.n_head} heads × {shape.head_dim}",
        "GQA": f"2 × {shape.n_kv_heads} KV heads × {shape.head_dim}",
        "MQA": f"2 × 1 KV head × {shape.head_dim}",
        "MLA": f"latent {shape.latent_dim} + RoPE key {shape.rope_dim}",
    }
    per_token = cache_sizes(shape, 1, 1, nbytes)
    top = max(sizes.values()) or 1
    rows = []
    for scheme, total in sizes.items():
        mine = scheme == shape.scheme
        bar = (
            f"<div style='background:#2471a3;height:12px;width:{max(1, round(200 * total / top))}"
            "px'></div>"
        )
        ratio = (
            ""
            if scheme == "MHA" or not total
            else "n/a: MLA"
            if scheme == "GQA" and shape.scheme == "MLA"
            else "same as MHA"
            if total == sizes["MHA"]
            else f"{sizes['MHA'] / total:,.1f}× smaller"
        )
        cells = [
            f"<b>{scheme}</b>" + (" ◀ this model" if mine else ""),
            html.escape(per_layer_values[scheme]),
            format_bytes(per_token[scheme]),
            f"<b>{format_bytes(total)}</b>",
            ratio,
            bar,
        ]
        style = " style='background:#eaf2f8'" if mine else ""
        td = "<td style='padding:2px 10px;white-space:nowrap'>"
        rows.append(f"<tr{style}>" + "".join(f"{td}{c}</td>" for c in cells) + "</tr>")
    head = ["scheme", "one token, one layer (values)", "per token", "total", "vs MHA", ""]
    caption = (
        f"{shape.n_layer} layers, {seq_len:,} positions × batch {batch_size}, {dtype} ({nbytes} "
        "B per value)"
    )
    if shape.source:
        caption += f"; numbers from {html.escape(shape.source)}"
    table = (
        f"<div style='margin:4px 0'>{caption}</div><table><tr>"
        + "".join(
            f"<th style='padding:2px 10px;text-align:left;white-space:nowrap'>{h}</th>"
            for h in head
        )
        + "</tr>"
        + "".join(rows)
        + "</table>"
    )
    return sizes, table


class KVCacheCalculator:
    """Preset, layers, heads, KV heads, head dim, MLA latent/RoPE sizes, sequence, batch and dtype
    -> the KV cache size of MHA, GQA, MQA and MLA side by side.

    Choosing a preset loads a published model shape (``ar_lab.perf.kv_sizing.KV_PRESETS``); editing
    any number switches the preset to "custom". ``sizes`` holds the last result (bytes per
    scheme) and ``error`` the message for an impossible shape, so tests can drive it headlessly.
    """

    def __init__(self, preset: str = "Llama 2 7B", dtype: str = "bfloat16"):
        import ipywidgets as W

        from ar_lab.perf.kv_sizing import BYTES_PER_VALUE, KV_PRESETS

        if preset not in KV_PRESETS:
            raise BadValue(
                f"unknown preset {preset!r}; choose one of {list(KV_PRESETS)}", arg="preset"
            )
        style = {"description_width": "120px"}
        box = dict(style=style, layout=W.Layout(width="260px"))

        if dtype not in BYTES_PER_VALUE:
            raise BadValue(
                f"dtype must be one of {sorted(BYTES_PER_VALUE)}, got {dtype!r}", arg="dtype"
            )
        self._lowest = {}  # control -> the smallest whole number it takes

        def number(description, low):
            control = W.IntText(
                1, description=description, tooltip=f"a whole number >= {low}", **box
            )
            self._lowest[control] = low
            return control

        self.preset = W.Dropdown(
            options=[*KV_PRESETS, "custom"], value=preset, description="preset", **box
        )
        self.layers = number("layers", 1)
        self.heads = number("query heads", 1)
        self.kv_heads = number("KV heads (GQA)", 1)
        self.head_dim = number("head dim", 1)
        self.latent = number("MLA latent", 1)
        self.rope = number("MLA RoPE key", 0)
        self.seq_len = number("sequence", 0)
        self.batch = number("batch", 1)
        self.dtype = W.Dropdown(
            options=list(BYTES_PER_VALUE), value=dtype, description="dtype", **box
        )
        self.output = W.HTML()
        self.sizes: dict[str, int] = {}
        self.error, self.refused = "", None
        self._loading = False
        self._numbers = [
            self.layers,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.latent,
            self.rope,
        ]
        self.preset.observe(lambda _change: self._load_preset(), names="value")
        for c in [*self._numbers, self.seq_len, self.batch, self.dtype]:
            c.observe(lambda change: self._edited(change), names="value")
        left = W.VBox([self.preset, self.layers, self.heads, self.kv_heads, self.head_dim])
        right = W.VBox([self.latent, self.rope, self.seq_len, self.batch, self.dtype])
        self.widget = W.VBox([W.HBox([left, right]), self.output])
        self._load_preset()

    def _load_preset(self) -> None:
        from ar_lab.perf.kv_sizing import KV_PRESETS

        name = self.preset.value
        if name in KV_PRESETS:
            s = KV_PRESETS[name]
            self._loading = True
            try:
                values = [s.n_layer, s.n_head, s.n_kv_heads, s.head_dim, s.latent_dim, s.rope_dim]
                for control, value in zip(self._numbers, values, strict=True):
                    control.value = value
                self.seq_len.value = s.context
            finally:
                self._loading = False
        self.update()

    def _edited(self, change) -> None:
        if self._loading:
            return
        if change["owner"] in self._numbers and self.preset.value != "custom":
            # the numbers no longer are the published model's (updates)
            self.preset.value = "custom"
        else:
            self.update()

    @property
    def shape(self):
        """The ``AttentionShape`` the controls describe (raises ValueError if impossible)."""
        from ar_lab.perf.kv_sizing import KV_PRESETS, AttentionShape

        for control, low in self._lowest.items():
            whole_number(control.description, control.value, low)
        heads, kv = int(self.heads.value), int(self.kv_heads.value)
        if self.preset.value in KV_PRESETS:
            scheme, source = (
                KV_PRESETS[self.preset.value].scheme,
                KV_PRESETS[self.preset.value].source,
            )
        else:
            scheme, source = ("MHA" if kv == heads else "MQA" if kv == 1 else "GQA"), ""
        return AttentionShape(
            int(self.layers.value),
            heads,
            kv,
            int(self.head_dim.value),
            int(self.latent.value),
            int(self.rope.value),
            context=max(1, int(self.seq_len.value)),
            scheme=scheme,
            source=source,
        )

    def update(self) -> None:

        try:
            self.sizes, table = kv_cache_table_html(
                self.shape, int(self.seq_len.value), int(self.batch.value), self.dtype.value
            )
        except ValueError as e:
            self.sizes = {}
            self.output.value = refuse(self, e)
            return
        self.error, self.refused = "", None
        self.output.value = table


    def _repr_mimebundle_(self, **kwargs):  # shows its widget when left last in a cell
        return self.widget._repr_mimebundle_(**kwargs)

def kv_cache_calculator(preset: str = "Llama 2 7B", dtype: str = "bfloat16") -> KVCacheCalculator:
    """Build the chapter-04 calculator (display it by leaving it last in a cell)."""
    return KVCacheCalculator(preset, dtype)
