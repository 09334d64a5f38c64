"""OpenAI Chat Completions request bodies (`POST /v1/chat/completions`) → `MessagesRequest`.

Messages: `system` / `developer` (see `openai_items`), `user` (a string or text parts),
`assistant` (content, `reasoning_content` — DeepSeek's field for its reasoning — and
`tool_calls`), `tool` (`tool_call_id` + content: a tool_result). Thinking follows the same
controls as the Anthropic side (`thinking`, `reasoning_effort`) plus ds4's boolean `think`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ds4jax.chat.anthropic import MessagesRequest, stop_strings, text_of, thinking_controls
from ds4jax.chat.bodies.common import validate
from ds4jax.chat.bodies.openai import ChatAssistant, ChatBody, ChatInstruction, ChatUser
from ds4jax.chat.conversation import Conversation, ToolCall
from ds4jax.chat.openai_items import Builder, arguments_of, offered, tools_of


@dataclass
class ChatRequest:
    request: MessagesRequest
    include_usage: bool = False  # `stream_options.include_usage`: a final usage chunk


def parse_chat_request(body: Any, *, max_context: int | None = None,
                       checked: bool = False) -> ChatRequest:  # fmt: skip
    """Validate (`bodies.openai.ChatBody`) and convert a `/v1/chat/completions` body;
    `checked`: `validate`'s."""
    return chat_request(validate(ChatBody, body, checked=checked), max_context)


def chat_request(c: ChatBody, max_context: int | None = None) -> ChatRequest:
    schemas, choice = offered(tools_of(c.tools).schemas, c)
    thinking = c.think if c.think is not None else c.thinking
    on, think_max, budget = thinking_controls(thinking, c.reasoning_effort, c.model, max_context)

    b = Builder()
    for m in c.messages:
        if isinstance(m, ChatInstruction):
            b.instruction(text_of(m.content))
        elif isinstance(m, ChatUser):
            b.user_text(text_of(m.content))
        elif isinstance(m, ChatAssistant):
            if m.reasoning_content is not None:
                b.reasoning(m.reasoning_content)
            b.assistant_text(text_of(m.content))
            for call in m.tool_calls or []:
                fn = call.function
                b.call(ToolCall(name=fn.name, arguments=arguments_of(fn.arguments), id=call.id))
        else:
            b.tool_output(m.tool_call_id, text_of(m.content))

    hint = c.prompt_cache_key or c.user
    req = MessagesRequest(
        conversation=Conversation(b.finish(schemas), thinking=on, think_max=think_max),
        model=c.model,
        max_tokens=c.max_completion_tokens or c.max_tokens,
        max_tokens_field="max_completion_tokens" if c.max_completion_tokens else "max_tokens",
        stream=c.stream,
        stop_sequences=stop_strings(c.stop),
        temperature=c.temperature,
        top_p=c.top_p,
        top_k=c.top_k,
        tool_choice=choice,
        thinking_budget=budget,
        user_id=hint[:256] if hint else None,
        logprobs=(c.top_logprobs or 0) if c.logprobs else None,
        seed=c.seed,
    )
    include = c.stream_options is not None and c.stream_options.include_usage is True
    return ChatRequest(request=req, include_usage=include)
