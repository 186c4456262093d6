"""The HTML report: self-contained, and it really renders in headless Chromium."""

import shutil
import struct
import subprocess
import zlib

import pytest

from fairscale.report import Box, ReportData, render_html, write_html

GIB = 2**30


def _data():
    boxes = [Box(row=s, kind=k, microbatch=m, start=t, end=t + 1)
             for s, k, m, t in [(0, "F", 0, 0), (0, "F", 1, 1), (1, "F", 0, 1), (1, "B", 0, 2), (0, "B", 0, 3)]]
    memory = [{"parameters": 2 * GIB, "gradients": 2 * GIB, "optimizer": 4 * GIB, "activations": 1 * GIB},
              {"parameters": 1 * GIB, "gradients": 1 * GIB, "optimizer": 2 * GIB, "buffers": 0.5 * GIB}]
    return ReportData(title="GPT on 8 ranks", text="stage 0: layers.[0-1]\nstage 1: layers.[2-3]",
                      mesh=(2, 2, 2), memory=memory, capacity_bytes=16 * GIB, timeline=boxes)


def test_html_has_every_picture_and_no_network_reference():
    page = render_html(_data())
    for figure in ('id="mesh"', 'id="memory"', 'id="timeline"'):
        assert figure in page
    assert page.count('class="rank"') == 8
    assert page.count('class="action"') == 5
    assert page.count('class="mem"') == 8
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "")
    assert "https://" not in page and "<script" not in page


def test_a_plan_without_pipeline_has_no_timeline():
    data = _data()
    data.timeline = []
    assert 'id="timeline"' not in render_html(data)


def _png_pixels(path):
    """Decode an 8-bit, non-interlaced RGB/RGBA PNG (what Chromium writes) into rows of bytes."""
    blob = open(path, "rb").read()
    assert blob[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, width = 8, b"", 0
    while pos < len(blob):
        length, kind = struct.unpack(">I4s", blob[pos:pos + 8])
        chunk = blob[pos + 8:pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color = struct.unpack(">IIBB", chunk[:10])
            assert depth == 8 and color in (2, 6)
            bpp = 3 if color == 2 else 4
        elif kind == b"IDAT":
            idat += chunk
        pos += 12 + length
    raw, stride, rows, prev = zlib.decompress(idat), width * bpp, [], bytearray(width * bpp)
    for y in range(height):
        f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
        for i in range(stride):
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1:
                line[i] = (line[i] + a) & 255
            elif f == 2:
                line[i] = (line[i] + b) & 255
            elif f == 3:
                line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        rows.append(bytes(line))
        prev = line
    return rows, bpp


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync", "--hide-scrollbars"]


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (.ci/run installs it)")
def test_report_renders_in_headless_chromium(tmp_path):
    page = write_html(_data(), tmp_path / "plan.html")
    profile = ["--user-data-dir=" + str(tmp_path / "profile")]
    dom = subprocess.run([CHROMIUM, *FLAGS, *profile, "--dump-dom", page.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert dom.count("<svg") == 3 and dom.count('class="rank"') == 8
    shot = tmp_path / "shot.png"
    subprocess.run([CHROMIUM, *FLAGS, *profile, f"--screenshot={shot}", "--window-size=1000,900", page.as_uri()],
                   capture_output=True, timeout=120)
    rows, bpp = _png_pixels(shot)
    # the mesh cells are filled #4e79a7: count pixels of that colour
    blue = sum(1 for row in rows for i in range(0, len(row), bpp) if row[i:i + 3] == b"\x4e\x79\xa7")
    assert blue > 8 * 20 * 20, f"only {blue} mesh-coloured pixels: the SVG did not render"


def test_report_of_a_real_plan_has_the_cost_models_bars_and_the_simulated_timeline(tmp_path):
    from fairscale.api import captured, resolve_cluster, search
    from fairscale.report.build import report_data
    from fairscale.testing.models import build

    case = build("gpt")
    batch = case.make_batch(0, 8)
    result = search(case.model, batch, devices=8, loss_fn=case.loss_fn,
                    constraints={"mesh": {"pp": 2, "dp": 2, "tp": 2}, "schedule": {"kind": "1f1b", "microbatches": 4}})
    graph, cluster = captured(case.model, batch, loss_fn=case.loss_fn), resolve_cluster(8)
    data = report_data(result.plan, graph, cluster, title="gpt")
    assert data.mesh == (2, 2, 2)
    assert len(data.memory) == 2 and all(sum(parts.values()) > 0 for parts in data.memory)
    predicted = [gib * 2**30 for gib in result.plan.predicted.memory_gib]
    assert [sum(parts.values()) for parts in data.memory] == pytest.approx(predicted, rel=1e-6)
    # one forward and one backward box per stage and microbatch, on the two pipeline ranks
    assert sorted((b.kind, b.row) for b in data.timeline) == sorted([(k, r) for k in "FB" for r in (0, 1)] * 4)
    page = render_html(data)
    assert page.count('class="action"') == 16 and page.count('class="rank"') == 8
