"""Multi-hop QA benchmarks as `Task`s: HotpotQA, 2WikiMultihopQA, MuSiQue, FlashRAG versions.

In the distractor setting each task carries its own passage pool (one `Passage` per
paragraph, sentences joined), so the search tool needs no external corpus. Answers hold
every alias, answer first. The original files and the hub conversions store the same
fields in different shapes (lists of pairs vs dicts of lists); both are accepted.

Question/answer files (no paragraphs: ReAct's `hotpot_dev_v1_simplified.json`, R1-Searcher's
`*_500.jsonl` dev samples) give open-domain tasks without a pool: they are evaluated with a
corpus index or a retrieval server (`tool_qa_env(corpus_index=...)`), and refused without
one. Their ids are the file's own `idx` where it has one, else the record's position in the
file (`<benchmark>-<split>-<n>`), so they are stable.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Iterable
from typing import Any

from copes.envs.tasks.base import Passage, Task
from copes.envs.tasks.io import SchemaError, load_records, other_fields, required

logger = logging.getLogger(__name__)

HOTPOTQA_SOURCE = "hotpotqa/hotpot_qa"
TWOWIKI_SOURCE = "voidful/2WikiMultihopQA"
MUSIQUE_SOURCE = "dgslibisey/MuSiQue"
FLASHRAG_SOURCE = "RUC-NLPIR/FlashRAG_datasets"

_MUSIQUE_CONSUMED = ("id", "question", "answer", "answer_aliases", "paragraphs")


def load_hotpotqa(
    source: str | os.PathLike = HOTPOTQA_SOURCE, split: str = "validation", limit: int | None = None
) -> list[Task]:
    """HotpotQA (distractor): 10 paragraphs per question, hub or original-file shape; a
    question/answer file gives open-domain tasks."""
    records = load_records(source, split=split, config="distractor", limit=limit)
    return [_qa_task(record, index, "hotpotqa", split) for index, record in enumerate(records)]


def load_2wiki(
    source: str | os.PathLike = TWOWIKI_SOURCE, split: str = "validation", limit: int | None = None
) -> list[Task]:
    """2WikiMultihopQA: the original `dev.json` shape (or a hub conversion of it); a
    question/answer file gives open-domain tasks."""
    records = load_records(source, split=split, limit=limit)
    return [_qa_task(record, index, "2wiki", split) for index, record in enumerate(records)]


def load_musique(
    source: str | os.PathLike = MUSIQUE_SOURCE,
    split: str = "validation",
    limit: int | None = None,
    include_unanswerable: bool = False,
) -> list[Task]:
    """MuSiQue: 20 paragraphs per question; answers are `answer` plus `answer_aliases`.

    Questions marked `answerable: false` (the "full" version's contrast questions, whose
    supporting paragraph was removed) are skipped unless `include_unanswerable`, because
    their gold answer is not recoverable from the pool. `limit` counts kept tasks.
    """
    tasks: list[Task] = []
    skipped = 0
    for index, record in enumerate(load_records(source, split=split)):
        if limit is not None and len(tasks) >= limit:
            break
        answerable = bool(record.get("answerable", True))
        if not answerable and not include_unanswerable:
            skipped += 1
            continue
        if _question_answer_only(record):
            tasks.append(_open_domain_task(record, index, "musique", split))
            continue
        paragraphs = required(record, "paragraphs", benchmark="musique", index=index)
        passages = []
        for paragraph in paragraphs:
            if not isinstance(paragraph, dict) or "paragraph_text" not in paragraph:
                raise SchemaError(
                    f"musique: record {index} has a paragraph without 'paragraph_text' "
                    f"({str(paragraph)[:80]!r}); expected {{idx, title, paragraph_text, "
                    f"is_supporting}}"
                )
            passages.append(
                Passage(
                    title=str(paragraph.get("title", "")),
                    text=str(paragraph["paragraph_text"]).strip(),
                    id=str(paragraph.get("idx", len(passages))),
                )
            )
        supporting = [p for p in paragraphs if p.get("is_supporting")]
        aliases = [required(record, "answer", benchmark="musique", index=index)]
        aliases += record.get("answer_aliases") or []
        tasks.append(
            Task(
                id=str(record.get("id") or f"musique-{split}-{index}"),
                question=str(required(record, "question", benchmark="musique", index=index)),
                answers=_aliases(aliases, "musique", index),
                kind="qa",
                passages=tuple(passages),
                source="musique",
                metadata={
                    "supporting_titles": _unique(str(p.get("title", "")) for p in supporting),
                    "supporting_idx": [p.get("idx") for p in supporting],
                    **other_fields(record, *_MUSIQUE_CONSUMED),
                },
            )
        )
    if skipped:
        logger.info("musique: skipped %d unanswerable questions", skipped)
    return tasks


def load_flashrag(
    source: str | os.PathLike = FLASHRAG_SOURCE,
    split: str = "dev",
    limit: int | None = None,
    dataset: str = "hotpotqa",
) -> list[Task]:
    """A FlashRAG open-corpus version (`golden_answers`, no passages).

    `dataset` is the hub config (`hotpotqa`, `2wikimultihopqa`, `musique`, ...) and names the
    tasks' source `flashrag-<dataset>`. These tasks need the open-corpus retrieval mode.
    """
    benchmark = f"flashrag-{dataset}"
    tasks = []
    for index, record in enumerate(load_records(source, split=split, config=dataset, limit=limit)):
        golden = required(record, "golden_answers", benchmark=benchmark, index=index)
        if isinstance(golden, str):
            golden = [golden]
        extra = record.get("metadata")
        tasks.append(
            Task(
                id=str(record.get("id") or f"{benchmark}-{split}-{index}"),
                question=str(required(record, "question", benchmark=benchmark, index=index)),
                answers=_aliases(golden, benchmark, index),
                kind="qa",
                source=benchmark,
                metadata={
                    **(extra if isinstance(extra, dict) else {}),
                    **other_fields(record, "id", "question", "golden_answers", "metadata"),
                },
            )
        )
    return tasks


# What a question/answer-only record may hold besides its question and answer.
_QA_ONLY_EXTRAS = frozenset({"idx", "type", "gen_text_store", "level"})
_PASSAGE_FIELDS = ("context", "paragraphs", "supporting_facts")


def _question_answer_only(record: dict[str, Any]) -> bool:
    """A record of a question/answer file: a question and an answer, no passage fields."""
    return (
        "question" in record
        and "answer" in record
        and not any(key in record for key in _PASSAGE_FIELDS)
        and set(record) - {"question", "answer", "id", "_id"} <= _QA_ONLY_EXTRAS
    )


def _qa_task(record: dict[str, Any], index: int, benchmark: str, split: str) -> Task:
    """A HotpotQA/2Wiki record: with its paragraphs, or open-domain (question and answer)."""
    if _question_answer_only(record):
        return _open_domain_task(record, index, benchmark, split)
    return _context_task(record, index, benchmark)


def _open_domain_task(record: dict[str, Any], index: int, benchmark: str, split: str) -> Task:
    """A question with its gold answer and no passages (it needs a corpus to search)."""
    record_id = record.get("id", record.get("_id"))
    if record_id is None:
        number = record.get("idx", index)
        record_id = f"{benchmark}-{split}-{number}"
    answer = required(record, "answer", benchmark=benchmark, index=index)
    return Task(
        id=str(record_id),
        question=str(required(record, "question", benchmark=benchmark, index=index)),
        answers=_aliases([answer], benchmark, index),
        kind="qa",
        source=benchmark,
        metadata={"open_domain": True, **other_fields(record, "id", "_id", "question", "answer")},
    )


def _context_task(record: dict[str, Any], index: int, benchmark: str) -> Task:
    """A HotpotQA/2Wiki record (either shape) as a task with its 10-paragraph pool."""
    context = _pairs(
        required(record, "context", benchmark=benchmark, index=index),
        ("sentences", "content"),
        benchmark=benchmark,
        field="context",
        index=index,
    )
    passages = tuple(
        Passage(title=str(title), text=_join(sentences, benchmark, index), id=str(position))
        for position, (title, sentences) in enumerate(context)
    )
    facts = _pairs(
        record.get("supporting_facts") or [],
        ("sent_id",),
        benchmark=benchmark,
        field="supporting_facts",
        index=index,
    )
    titles = {passage.title for passage in passages}
    supporting_titles = _unique(str(title) for title, _ in facts)
    missing = [title for title in supporting_titles if title not in titles]
    if missing:
        logger.warning(
            "%s: record %d cites titles not in its context: %s", benchmark, index, missing
        )
    record_id = record.get("id", record.get("_id"))
    answer = required(record, "answer", benchmark=benchmark, index=index)
    consumed = ("id", "_id", "question", "answer", "context", "supporting_facts")
    return Task(
        id=str(record_id) if record_id is not None else f"{benchmark}-{index}",
        question=str(required(record, "question", benchmark=benchmark, index=index)),
        answers=_aliases([answer], benchmark, index),
        kind="qa",
        passages=passages,
        source=benchmark,
        metadata={
            "supporting_titles": supporting_titles,
            "supporting_facts": [[str(title), int(sent)] for title, sent in facts],
            **other_fields(record, *consumed),
        },
    )


def _pairs(
    value: Any, second_keys: tuple[str, ...], *, benchmark: str, field: str, index: int
) -> list[tuple[Any, Any]]:
    """(title, x) pairs from `[[title, x], ..]` or `{"title": [..], <second_key>: [..]}`.

    A JSON string (how some hub conversions store nested lists) is decoded first.
    """
    if isinstance(value, str):
        with contextlib.suppress(json.JSONDecodeError):  # else reported below
            value = json.loads(value)
    if isinstance(value, dict) and "title" in value:
        second = next((key for key in second_keys if key in value), None)
        if second is not None and len(value[second]) == len(value["title"]):
            return list(zip(value["title"], value[second], strict=True))
    elif isinstance(value, list) and all(
        isinstance(item, (list, tuple)) and len(item) == 2 for item in value
    ):
        return [(item[0], item[1]) for item in value]
    raise SchemaError(
        f"{benchmark}: record {index} has an unreadable {field!r} ({str(value)[:100]!r}); "
        f"expected [[title, {second_keys[0]}], ..] (original files) or "
        f"{{'title': [..], '{second_keys[0]}': [..]}} (hub) with equal lengths"
    )


def _join(sentences: Any, benchmark: str, index: int) -> str:
    if isinstance(sentences, str):
        return sentences.strip()
    if not isinstance(sentences, (list, tuple)):
        raise SchemaError(
            f"{benchmark}: record {index} has a paragraph whose sentences are a "
            f"{type(sentences).__name__}; expected a list of strings"
        )
    return " ".join(text for text in (str(s).strip() for s in sentences) if text)


def _aliases(values: Iterable[Any], benchmark: str, index: int) -> tuple[str, ...]:
    aliases = _unique(str(value).strip() for value in values if str(value).strip())
    if not aliases:
        raise SchemaError(f"{benchmark}: record {index} has no non-empty gold answer")
    return tuple(aliases)


def _unique(values: Iterable[str]) -> list[str]:
    """Values in first-seen order, duplicates dropped."""
    return list(dict.fromkeys(values))
