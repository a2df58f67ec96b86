"""Real documents that install from packages (../shared/MODELS.md), for the demo, tests and benches.

aclsum ships 250 full ACL papers (S2ORC JSON). We read the files directly; the package's own
loader needs more dependencies.
"""
from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Paper:
    paper_id: str
    title: str
    abstract: str
    body: str  # paragraphs joined by blank lines, section headings kept

    @property
    def text(self) -> str:
        return f"{self.title}\n\nAbstract\n{self.abstract}\n\n{self.body}"


def aclsum_papers_dir() -> Path:
    try:
        dist = importlib.metadata.distribution("aclsum")
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError("the aclsum package is not installed: pip install aclsum==0.1.2") from None
    return Path(dist.locate_file("aclsum/dataset/paper_jsons"))


def load_paper(path: Path) -> Paper:
    raw = json.loads(path.read_text(encoding="utf-8"))
    parse = raw.get("pdf_parse") or {}
    paragraphs, section = [], None
    for para in parse.get("body_text", []):
        if para.get("section") and para["section"] != section:
            section = para["section"]
            paragraphs.append(section)
        paragraphs.append(para["text"])
    return Paper(
        paper_id=path.stem,  # the JSON's own paper_id is the year for many files
        title=raw.get("title") or "",
        abstract=raw.get("abstract") or "",
        body="\n\n".join(paragraphs),
    )


def aclsum_papers(limit: int | None = None) -> list[Paper]:
    """Papers in a stable order (sorted by file name)."""
    paths = sorted(aclsum_papers_dir().glob("*.json"))
    return [load_paper(p) for p in paths[:limit]]


def aclsum_reference_summaries(split: str = "test") -> dict[str, str]:
    """paper id -> its reference summary: the split's three one-sentence summaries (challenge,
    approach, outcome) joined in that order."""
    path = aclsum_papers_dir().parent / f"{split}.jsonl"
    out = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        row = json.loads(line)
        parts = row["summary"]
        out[row["id"]] = " ".join(parts[k] for k in ("challenge", "approach", "outcome"))
    return out


def aclsum_paper(paper_id: str) -> Paper:
    return load_paper(aclsum_papers_dir() / f"{paper_id}.json")
