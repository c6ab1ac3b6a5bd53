"""The dashboards as a person sees them: TensorBoard on a real run, rendered by headless Chromium.

The assertions read the page Chromium rendered (through the shadow roots of TensorBoard's Polymer
dashboards): the custom-scalars cards with their lines and min–max bands drawn, and the heatmap
images decoded. Screenshots of both dashboards are saved; with QKMONITOR_UPDATE_SCREENSHOTS=1 they
replace docs/custom_scalars.png and docs/images.png.
"""

from __future__ import annotations

import pytest
from PIL import Image

pytestmark = pytest.mark.browser

HEATMAPS = [
    "qkmonitor/heatmap/kappa",
    "qkmonitor/heatmap/entropy_norm",
    "qkmonitor/heatmap/max_prob",
]
LINE_CHARTS = [
    "kappa (a line per layer)",
    "entropy_norm (a line per layer)",
    "attn_erank (a line per layer)",
]
MARGIN_CHARTS = [
    "kappa layer 00 (heads: min, mean, max)",
    "entropy_norm layer 01 (heads: min, mean, max)",
    "attn_entropy_norm layer 01 (heads: min, mean, max)",
]

# Every custom-scalars card in the page, through the shadow roots: its kind, its title, how many
# line and band (area) paths with geometry its chart has drawn, and the colours its lines are
# stroked with as the page paints them (computed style).
CUSTOM_SCALAR_CARDS = r"""(() => {
  const cards = [], text = [];
  const drawn = (node, kind) => {
    const found = [];
    const walk = (m) => { if (m.shadowRoot) walk(m.shadowRoot);
      for (const c of m.children || []) {
        if (c.tagName === 'path' && c.classList.contains(kind)
            && (c.getAttribute('d') || '').length > 10) found.push(c);
        walk(c); } };
    walk(node);
    return found;
  };
  const paths = (node, kind) => drawn(node, kind).length;
  const strokes = (node) => drawn(node, 'line').map(p => getComputedStyle(p).stroke);
  const walk = (node) => { if (node.shadowRoot) walk(node.shadowRoot);
    for (const el of node.children || []) {
      const tag = el.tagName;
      if (tag === 'TF-CUSTOM-SCALAR-MULTI-LINE-CHART-CARD'
          || tag === 'TF-CUSTOM-SCALAR-MARGIN-CHART-CARD') {
        const box = el.getBoundingClientRect();  // where a person sees it
        cards.push({kind: tag.includes('MARGIN') ? 'margin' : 'multiline', title: el.title,
                    lines: paths(el, 'line'), areas: paths(el, 'area'), strokes: strokes(el),
                    top: box.top + window.scrollY, left: box.left});
      } else walk(el);
    } };
  walk(document);
  return cards;
})()"""

# The text a person can read on the page, shadow roots included (styles and scripts left out).
PAGE_TEXT = r"""(() => {
  const out = [];
  const walk = (node) => { if (node.shadowRoot) walk(node.shadowRoot);
    for (const c of node.childNodes) {
      if (c.nodeType === Node.TEXT_NODE) out.push(c.textContent);
      else if (!['STYLE', 'SCRIPT', 'TEMPLATE', 'NOSCRIPT'].includes(c.nodeName)) walk(c);
    } };
  walk(document.body);
  return out.join(' ').replace(/\s+/g, ' ');
})()"""

# Every image card: its tag and run, and the size of its decoded <img> (0 until it has loaded).
IMAGE_CARDS = r"""(() => {
  const cards = [];
  const walk = (node) => { if (node.shadowRoot) walk(node.shadowRoot);
    for (const el of node.children || []) {
      if (el.tagName === 'TF-IMAGE-LOADER') {
        let img = null;
        const find = (m) => { if (m.shadowRoot) find(m.shadowRoot);
          for (const c of m.children || []) { if (c.tagName === 'IMG') img = img || c; find(c); } };
        find(el);
        const ok = img && img.complete;
        cards.push({tag: el.tag, run: el.run, width: ok ? img.naturalWidth : 0,
                    height: ok ? img.naturalHeight : 0});
      } else walk(el);
    } };
  walk(document);
  return cards;
})()"""


# The run selector's colour of each run, as painted (its isolator button takes the run's colour):
# the legend a person reads a line's colour against.
RUN_COLOURS = r"""(() => {
  const colours = {};
  const walk = (node) => { if (node.shadowRoot) walk(node.shadowRoot);
    for (const el of node.children || []) {
      if (el.classList && el.classList.contains('isolator') && el.name)
        colours[el.name] = getComputedStyle(el).color;
      walk(el); } };
  walk(document);
  return colours;
})()"""


def rgb(colour: str) -> tuple[int, ...]:
    """``rgb(r, g, b)`` as the page computes a colour, as numbers."""
    return tuple(int(part) for part in colour.removeprefix("rgb(").rstrip(")").split(","))


def check_screenshot(path, size):
    """A PNG of the viewport's size, with TensorBoard's orange header and a page that is not
    blank."""
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == size
        rgb = image.convert("RGB")
        r, g, b = rgb.getpixel((size[0] // 2, 5))
        assert r > 200 and 80 < g < 180 and b < 80, f"no TensorBoard header at the top of {path}"
        assert len(rgb.getcolors(maxcolors=1 << 20) or []) > 200, f"{path} looks blank"


LOSS_CHART = "loss (training and validation)"


def test_custom_scalars_dashboard_draws_the_per_layer_charts(browser, tensorboard, screenshot_dir):
    layout = tensorboard.get_json("/data/plugin/custom_scalars/layout")  # what TensorBoard serves
    categories = [category["title"] for category in layout["category"]]
    titles = [chart["title"] for category in layout["category"] for chart in category["chart"]]
    assert set(LINE_CHARTS + MARGIN_CHARTS) <= set(titles)

    def drawn(cards):
        by_title = {card["title"]: card for card in cards or []}
        return (
            all(by_title.get(t, {}).get("lines", 0) >= 2 for t in LINE_CHARTS)  # two layers
            and all(by_title.get(t, {}).get("areas", 0) >= 1 for t in MARGIN_CHARTS)  # min-max band
            and by_title.get(LOSS_CHART, {}).get("lines", 0) >= 1  # the task's train_loss
        )

    size = (1640, 1320)
    # no smoothing and no outlier clipping: with four points per line, the raw values are the
    # picture
    browser.open(
        f"{tensorboard.url}/#custom_scalars&_smoothingWeight=0",
        *size,
        local_storage={"_ignoreYOutliers": "false"},
    )
    cards = browser.wait_for(CUSTOM_SCALAR_CARDS, drawn)
    text = browser.evaluate(PAGE_TEXT)
    shot = browser.screenshot(screenshot_dir / "custom_scalars.png")
    assert drawn(cards), f"charts not drawn (screenshot: {shot}): {cards}"
    # every chart of the layout is a card in the page, each kind as the layout says, read as a
    # person reads the page (top to bottom, left to right): the loss, then entropy_norm, kappa
    # and max_logit, and each "per layer over heads" category by metric, then layer 00, 01
    page = [card["title"] for card in sorted(cards, key=lambda c: (c["top"], c["left"]))]
    assert sorted(page) == sorted(titles)
    assert page[:4] == [
        LOSS_CHART,
        "entropy_norm (a line per layer)",
        "kappa (a line per layer)",
        "max_logit (a line per layer)",
    ], page
    heads = [t for t in page if "(heads:" in t]
    assert heads[:6] == [
        f"{metric} layer {layer:02d} (heads: min, mean, max)"
        for metric in ("entropy_norm", "kappa", "max_logit")
        for layer in (0, 1)
    ], page
    assert {card["title"] for card in cards if card["kind"] == "margin"} == {
        t for t in titles if "(heads:" in t
    }
    for category in categories:
        assert category in text
    assert categories[0] == "training" and text.index("training") < text.index("qkmonitor: ")
    assert (
        "qkmonitor/kappa/layer_00" in text and "qkmonitor/kappa/layer_01" in text
    )  # the lines' tags
    check_screenshot(shot, size)


def test_images_dashboard_shows_the_heatmaps_and_attention_patterns(
    browser, tensorboard, screenshot_dir
):
    tags = tensorboard.get_json("/data/plugin/images/tags")[tensorboard.run]
    assert set(HEATMAPS) <= set(tags)

    def loaded(
        cards,
    ):  # every card the checks below measure has its image (a tag may have two cards)
        ours = [card for card in cards or [] if card["run"] == tensorboard.run]
        shown = {card["tag"] for card in ours if card["width"] > 0}
        return (
            set(HEATMAPS) <= shown
            and any(tag.startswith("qkmonitor/attention/") for tag in shown)
            and all(card["width"] > 0 for card in ours if card["tag"] in HEATMAPS)
        )

    size = (1920, 1120)
    # the tag filter puts the heatmaps first, above the category with every qkmonitor image
    browser.open(f"{tensorboard.url}/#images&tagFilter=heatmap", *size)
    cards = browser.wait_for(IMAGE_CARDS, loaded)
    text = browser.evaluate(PAGE_TEXT)
    shot = browser.screenshot(screenshot_dir / "images.png")
    assert loaded(cards), f"images not shown (screenshot: {shot}): {cards}"
    import torch

    from qkmonitor.output.dashboards import heatmap_image

    height, width = heatmap_image(torch.zeros(2, 4), 0.0, 1.0).shape[
        :2
    ]  # 2 layers x 4 heads, framed
    for card in cards:
        if card["tag"] in HEATMAPS:
            assert (card["width"], card["height"]) == (width, height)
    assert {c["tag"] for c in cards if c["tag"].startswith("qkmonitor/attention/")} == {
        f"qkmonitor/attention/layer_{layer:02d}_head_{head:02d}"
        for layer in range(2)
        for head in range(2)
    }
    for tag in HEATMAPS:
        assert tag in text
    check_screenshot(shot, size)


def test_the_overlays_draw_each_layer_in_a_colour_of_its_own(browser, tensorboard):
    """A metric's overlay ("a line per layer") draws its layers in colours of their own, each its
    layer's run's colour in the run selector (TensorBoard colours by run: each layer's series is
    a run of its own, ``layers/layer_LL``), and the series are the run's own values."""

    def drawn(cards):
        by_title = {card["title"]: card for card in cards or []}
        return all(len(by_title.get(t, {}).get("strokes", ())) >= 2 for t in LINE_CHARTS)

    browser.open(f"{tensorboard.url}/#custom_scalars&_smoothingWeight=0", 1640, 1320)
    cards = browser.wait_for(CUSTOM_SCALAR_CARDS, drawn)
    assert drawn(cards), cards
    overlays = [card for card in cards if card["title"] in LINE_CHARTS]
    for card in overlays:  # two layers: two lines, in two colours
        assert len(card["strokes"]) == 2 and len(set(card["strokes"])) == 2, card
    layers = [f"{tensorboard.run}/layers/layer_{layer:02d}" for layer in range(2)]
    colours = browser.wait_for(RUN_COLOURS, lambda found: set(layers) <= set(found or ()))
    first, second = (rgb(colours[run]) for run in layers)
    assert sum((a - b) ** 2 for a, b in zip(first, second)) ** 0.5 > 60, colours  # told apart
    for card in overlays:  # each line in its layer's colour in the run selector
        assert set(card["strokes"]) == {colours[run] for run in layers}, (card, colours)
    for layer, run in enumerate(layers):  # the layer's run holds the run's values, step by step
        charted = tensorboard.get_json(
            f"/data/plugin/custom_scalars/scalars?run={run}&tag=%5Eqkmonitor/kappa%24"
        )["tag_to_events"]["qkmonitor/kappa"]
        own = tensorboard.get_json(
            f"/data/plugin/scalars/scalars?run={tensorboard.run}"
            f"&tag=qkmonitor/kappa/layer_{layer:02d}"
        )
        assert [e[1:] for e in charted] == [e[1:] for e in own] and len(own) == 4, run
