"""Which entries of the tool memory a checkpoint's text carries: the tool-call blocks that
occur in it, matched byte for byte. Apart from `disk.DiskStore` because it is text matching
on DSML that knows nothing of files or budgets, and is tested on its own.
"""

from __future__ import annotations

from ds4jax.chat import specials
from ds4jax.kvstore.store import ToolEntries


def tool_entries_in(text: str, tool_memory: ToolEntries | None) -> dict[str, str]:
    """The entries (tool id → DSML block) of `tool_memory` (a `ToolMemory` or a mapping)
    whose exact block occurs in `text`: every id of each such block (ds4 §2.7)."""
    if tool_memory is None:
        return {}
    items = list(tool_memory.items())
    open_tag = "<" + specials.DSML + "tool_calls>"
    close_tag = "</" + specials.DSML + "tool_calls>"
    if not items or open_tag not in text:
        return {}
    # a block is `<prefix><core>`, its core running from the opening tag to the closing one
    by_core: dict[str, dict[str, list[str]]] = {}
    loose: dict[str, list[str]] = {}
    for tid, block in items:
        k = block.find(open_tag)
        if k < 0 or not block.endswith(close_tag):
            loose.setdefault(block, []).append(tid)
        else:
            by_core.setdefault(block[k:], {}).setdefault(block[:k], []).append(tid)
    found: dict[str, str] = {}
    i = text.find(open_tag)
    while i >= 0:
        j = text.find(close_tag, i)
        if j < 0:
            break
        end = j + len(close_tag)
        for prefix, ids in by_core.get(text[i:end], {}).items():
            if i >= len(prefix) and text[i - len(prefix) : i] == prefix:
                found.update(dict.fromkeys(ids, prefix + text[i:end]))
        i = text.find(open_tag, end)
    for block, ids in loose.items():
        if block and block in text:
            found.update(dict.fromkeys(ids, block))
    return found
