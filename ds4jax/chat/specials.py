"""The DeepSeek V4 special-token strings the prompt template inserts.

They use U+FF5C `｜` and U+2581 `▁`. Only the template may turn one of these into a special
token id; the same bytes inside client text are ordinary text (see `segments.Segment`).
"""

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"

#: Every special string the template can emit, longest first so a scanner never stops
#: at a shorter string that is a prefix of a longer one.
TEMPLATE_SPECIALS: tuple[str, ...] = tuple(
    sorted(
        (BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END, DSML, LATEST_REMINDER),
        key=len,
        reverse=True,
    )
)
