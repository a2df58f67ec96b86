"""The report as one HTML file: plotly's JavaScript inlined once, then a div per figure.

Everything a job wrote (custom_ids, error messages) reaches the page through Jinja's
autoescaping, so a custom_id such as `<script>` is shown, never run.
"""
from __future__ import annotations

from datetime import datetime, timezone

import jinja2
import plotly.io as pio
from plotly.offline import get_plotlyjs

from batchd.report.totals import format_duration, totals_lines
from batchd.report.data import ReportData
from batchd.report.figures import COLORS, failure_kinds, sections

PLOT_CONFIG = {"displaylogo": False, "responsive": True, "displayModeBar": False}   # drag zooms; a double click resets

TEMPLATE = jinja2.Environment(autoescape=True, trim_blocks=True, lstrip_blocks=True).from_string("""\
<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>batchd report: {{ name }}</title>
<style>
  body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 0; color: #111827; background: #f9fafb; }
  main { max-width: 1180px; margin: 0 auto; padding: 24px; }
  h1 { margin: 0 0 4px; font-size: 26px; }
  h2 { margin: 0 0 12px; font-size: 18px; border-left: 6px solid var(--accent, #6b7280); padding-left: 10px; }
  .sub { color: #6b7280; margin: 0 0 20px; }
  section { background: white; border: 1px solid #e5e7eb; border-radius: 8px; padding: 16px 20px; margin: 0 0 18px; }
  .cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 10px; }
  .card { border: 1px solid #e5e7eb; border-radius: 6px; padding: 10px 12px; }
  .card .value { font-size: 22px; font-weight: 600; }
  .card .label { color: #6b7280; font-size: 13px; }
  pre.totals { background: #f3f4f6; padding: 10px 12px; border-radius: 6px; margin: 14px 0 0; white-space: pre-wrap; }
  table { border-collapse: collapse; margin-top: 8px; font-size: 14px; }
  td, th { text-align: left; padding: 4px 12px 4px 0; vertical-align: top; }
  th { color: #6b7280; font-weight: 500; }
  .note { color: #6b7280; font-style: italic; }
  td.message { font-family: ui-monospace, monospace; font-size: 13px; max-width: 760px; overflow-wrap: anywhere; }
</style>
<script type="text/javascript">{{ plotly_js | safe }}</script>
</head>
<body>
<main>
<h1>Batch {{ name }}</h1>
<p class="sub">{{ state }} &middot; report written {{ written }}</p>
<section id="totals">
  <h2>Totals</h2>
  <div class="cards">
  {% for label, value in cards %}
    <div class="card"><div class="value">{{ value }}</div><div class="label">{{ label }}</div></div>
  {% endfor %}
  </div>
  <pre class="totals">{{ totals }}</pre>
</section>
{% for section in sections %}
<section id="{{ section.key }}" style="--accent: {{ colors[section.key] }}">
  <h2>{{ section.title }}</h2>
  {% if section.html %}
  {{ section.html | safe }}
  {% else %}
  <p class="note">{{ section.note }}</p>
  {% endif %}
  {% if section.stats %}
  <table class="stats">
  {% for label, value in section.stats %}
    <tr><th>{{ label }}</th><td>{{ value }}</td></tr>
  {% endfor %}
  </table>
  {% endif %}
  {% if section.key == "failures" and failure_kinds %}
  <table class="examples">
    <tr><th>kind</th><th>custom_id</th><th>message</th></tr>
  {% for kind in failure_kinds %}
  {% for custom_id, message in kind.examples %}
    <tr><td>{{ kind.kind }}</td><td>{{ custom_id }}</td><td class="message">{{ message }}</td></tr>
  {% endfor %}
  {% endfor %}
  </table>
  {% endif %}
</section>
{% endfor %}
</main>
</body>
</html>
""")


def render_report(data: ReportData) -> str:
    p = data.progress
    rendered = []
    for section in sections(data):
        html = (pio.to_html(section.figure, full_html=False, include_plotlyjs=False, config=PLOT_CONFIG,
                            div_id=f"plot-{section.key}") if section.figure is not None else "")
        rendered.append({"key": section.key, "title": section.title, "html": html, "note": section.note,
                         "stats": section.stats})
    return TEMPLATE.render(
        name=p.name, plotly_js=get_plotlyjs(), colors=COLORS, sections=rendered, failure_kinds=failure_kinds(data),
        state="finished" if p.done else f"{p.remaining:,} of {p.total:,} jobs not finished yet",
        written=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        totals="\n".join(totals_lines(p)), cards=_cards(data))


def _cards(data: ReportData) -> list[tuple[str, str]]:
    p = data.progress
    cards = [("jobs", f"{p.total:,}"), ("succeeded", f"{p.succeeded:,}"),
             ("failed", f"{p.counts.get('failed', 0):,}"),
             ("wall time (first submit to last result)", format_duration(p.wall_s)),
             ("workers busy", format_duration(p.busy_s)),
             ("documents/hour", f"{p.documents_per_hour:,.1f}"),
             ("prompt tokens", f"{p.prompt_tokens:,}"),
             ("generated tokens", f"{p.generated_tokens:,}"),
             ("generated tokens/s while busy", f"{p.tokens_per_s:,.1f}")]
    if p.effective_prompt_tokens != p.prompt_tokens:
        cards.insert(7, ("prompt tokens after compression", f"{p.effective_prompt_tokens:,}"))
    return cards
