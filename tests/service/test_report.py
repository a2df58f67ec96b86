"""`batchd report` writes one HTML file that a real browser renders with every plot: headless
Chromium (Debian's package) loads it without a network, and its screenshot is checked for each
section's colour; the page it ran shows a dangerous custom_id as text. `batchd run` ends with the
totals the report opens with."""
from __future__ import annotations

import random
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from batchd.jobs.progress import batch_progress
from batchd.report.figures import COLORS, spread_over_bins, time_bin_seconds
from batchd.report.totals import totals_lines
from tests.service.batch_history import PastJob, write_batch
from tests.service.conftest import batchd_cli, service_env

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed "
                                    "(apt-get install -y chromium; .ci/run installs it)")
EVIL_ID = "<script>document.title='pwned'</script>"
PAGE_WIDTH, PAGE_HEIGHT = 1280, 4200


def overnight_batch(settings, name: str = "overnight") -> list[PastJob]:
    """40 jobs over ten minutes: varied lengths and timings, half speculating, a quarter
    compressed, failures of two kinds (one with a custom_id that is HTML), one still queued."""
    rng = random.Random(7)
    jobs = []
    for i in range(40):
        claimed = 600 - i * 14
        prompt_tokens = rng.randint(200, 4000)
        jobs.append(PastJob(
            f"paper-{i:03d}", "w " * prompt_tokens, submitted_ago=660, claimed_ago=claimed,
            finished_ago=claimed - rng.uniform(5, 40), prompt_tokens=prompt_tokens,
            effective_prompt_tokens=prompt_tokens // rng.randint(3, 12) if i % 4 == 0 else None,
            generated_tokens=rng.randint(20, 256), prefill_s=rng.uniform(0.05, 2.0), decode_s=rng.uniform(1, 30),
            acceptance_per_position=[rng.uniform(0.5, 0.9) * 0.8 ** k for k in range(4)] if i % 2 else []))
    jobs += [PastJob("too-long-1", "w", outcome="failed", submitted_ago=660, claimed_ago=100, finished_ago=99,
                     error_kind="too_long", error_message="the prompt has 9,000 tokens; submit with --compress auto"),
             PastJob(EVIL_ID, "w", outcome="failed", submitted_ago=660, claimed_ago=90, finished_ago=89,
                     error_kind="bad_input", error_message="<b>unknown</b> role 'robot'"),
             PastJob("later", "w", outcome="pending", submitted_ago=660)]
    write_batch(settings, name, jobs)
    return jobs


def render_in_chromium(page: Path, out: Path) -> tuple[str, Path]:
    """(the DOM after scripts ran, a screenshot of the whole page) from headless Chromium."""
    common = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--hide-scrollbars",
              "--no-first-run", "--virtual-time-budget=15000", f"--window-size={PAGE_WIDTH},{PAGE_HEIGHT}"]
    dom = subprocess.run([*common, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=180)
    assert dom.returncode == 0, dom.stderr[-2000:]
    shot = out / "report.png"
    taken = subprocess.run([*common, f"--screenshot={shot}", page.as_uri()], capture_output=True, text=True,
                           timeout=180)
    assert taken.returncode == 0 and shot.exists(), taken.stderr[-2000:]
    return dom.stdout, shot


def pixels_of(image, hex_color: str, tolerance: int = 6) -> int:
    target = tuple(int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return sum(count for count, rgb in image.getcolors(maxcolors=1 << 24)
               if all(abs(a - b) <= tolerance for a, b in zip(rgb, target)))


@pytest.fixture
def report_file(settings, redis_url, queue_prefix, tmp_path) -> Path:
    overnight_batch(settings)
    env = service_env(settings.database_url, redis_url, tmp_path / "data", queue_prefix)
    out = batchd_cli(["report", "--batch", "overnight", "-o", str(tmp_path / "overnight.html")], env)
    assert out.returncode == 0, out.stderr.decode()
    stdout = out.stdout.decode().splitlines()
    expected = totals_lines(batch_progress(settings.database_url, "overnight"))   # one job still pending: ...
    assert stdout[0] == expected[0] and stdout[3].endswith("(40 succeeded)")    # ... its wall time runs on
    assert stdout[4] == f"report: {tmp_path / 'overnight.html'}"
    return tmp_path / "overnight.html"


@needs_chromium
@pytest.mark.parametrize("database_url", ["postgresql"], indirect=True)
def test_report_renders_every_plot_in_headless_chromium(report_file, tmp_path):
    html = report_file.read_text()
    assert not re.search(r"<script[^>]+src=|<link[^>]+href=\"?https?:", html), "the page must need no network"
    dom, shot = render_in_chromium(report_file, tmp_path)
    # plotly drew an SVG per figure: six sections, each with a plot for this batch
    for key in COLORS:
        assert re.search(rf'id="plot-{key}"[^>]*>.*?class="main-svg"', dom, re.S), f"no plot drawn for {key}"
    # the custom_id that is HTML is text on the page, not an element
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom and "<title>batchd report: overnight</title>" in dom
    assert "&lt;b&gt;unknown&lt;/b&gt;" in dom
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert image.size == (PAGE_WIDTH, PAGE_HEIGHT)
    drawn = {key: pixels_of(image, color) for key, color in COLORS.items()}
    assert all(count > 300 for count in drawn.values()), drawn   # each section's bars are on screen


@needs_chromium
@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_a_batch_without_speculation_compression_or_failures_says_so(settings, redis_url, queue_prefix, tmp_path):
    write_batch(settings, "plain", [PastJob(f"d{i}", "text " * 50, claimed_ago=50 - i, finished_ago=40 - i,
                                            prompt_tokens=60, generated_tokens=30) for i in range(5)])
    env = service_env(settings.database_url, redis_url, tmp_path / "data", queue_prefix)
    page = tmp_path / "plain.html"
    assert batchd_cli(["report", "--batch", "plain", "-o", str(page)], env).returncode == 0
    dom, shot = render_in_chromium(page, tmp_path)
    assert "No job used speculative decoding" in dom and "No job was compressed" in dom and "No job failed." in dom
    assert 'id="plot-throughput"' in dom and 'id="plot-acceptance"' not in dom
    from PIL import Image

    image = Image.open(shot).convert("RGB")
    assert pixels_of(image, COLORS["throughput"]) > 300 and pixels_of(image, COLORS["acceptance"]) < 300


def test_report_on_an_unknown_batch_is_one_line(sqlite_url, tmp_path):
    env = service_env(sqlite_url, None, tmp_path / "data", "x")
    out = batchd_cli(["report", "--batch", "nope"], env)
    assert out.returncode == 1 and out.stderr.decode().strip() == "Error: no batch named 'nope'; `batchd status` lists them"


def test_tokens_spread_over_the_bins_a_job_ran_in():
    array = np.zeros(4)
    spread_over_bins(array, 5.0, 25.0, 200.0, 10.0)     # 10 tokens/s from 5 s to 25 s
    assert array.tolist() == [50.0, 100.0, 50.0, 0.0]
    spread_over_bins(array, 31.0, 31.0, 7.0, 10.0)      # no interval: all in its end's bin
    assert array[3] == 7.0
    assert time_bin_seconds(60, max_bins=60) == 1 and time_bin_seconds(61, max_bins=60) == 2
    assert time_bin_seconds(10 * 3600, max_bins=60) == 600
