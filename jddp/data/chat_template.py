"""A tokenizer's chat template, rendered as transformers' `apply_chat_template` renders it, and
where in the rendered text the assistant speaks.

The template is the tokenizer directory's `chat_template.jinja`, else its tokenizer_config.json's
`chat_template` (a string, or a list of named templates whose `default` is taken), as
transformers reads them. It runs in the environment transformers gives it: Jinja2's immutable
sandbox with `trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension, a `{% generation %}`
tag, the filter `tojson` and the globals `raise_exception`, `strftime_now`, `dict` and
`namespace`; its variables are `messages`, `add_generation_prompt`, `tools` and `documents`
(None) and the special tokens tokenizer_config.json names (`bos_token`, `eos_token`, ...).

Where the assistant speaks (`assistant_spans`): a template with `{% generation %}` markers says
so itself (transformers' `return_assistant_tokens_mask`). Any other is rendered turn by turn, as
TRL's prompt/completion tokenization does: turn i spans from the end of the conversation before it
rendered with the generation prompt (`<|start_header_id|>assistant<|end_header_id|>\\n\\n`) to the
end of the conversation through it (the turn's text and its end-of-turn token). That holds for
templates whose renderings of a conversation's beginning begin its whole rendering (Llama 3,
ChatML / Qwen 2.5, Mistral, Gemma); one that rewrites earlier turns (Qwen 3 drops their reasoning)
is refused for `loss_on=completion` in one line.
"""

import dataclasses
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence

from jddp.errors import DataError, first_line

TEMPLATE_FILE = "chat_template.jinja"  # what transformers' save_pretrained writes today
CONFIG_FILE = "tokenizer_config.json"
# The special tokens transformers passes to a template (its SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_KEYS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)  # fmt: skip
# Names a message's reasoning is given under; transformers fills the first (and `thinking`)
# from whichever a message has, which the templates of reasoning models read.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class RenderError(Exception):
    """The template refused a conversation (its `raise_exception`) or failed on it: one line."""


@dataclasses.dataclass(frozen=True, eq=False)
class ChatTemplate:
    """A compiled chat template and the special tokens it is rendered with."""

    source: str  # the Jinja text
    where: str  # the file it came from, for messages
    special_tokens: Mapping[str, str]
    compiled: object = dataclasses.field(repr=False)  # a jinja2.Template

    @property
    def has_generation_markers(self) -> bool:
        return bool(_GENERATION_TAG.search(self.source))

    def render(self, messages: Sequence[Mapping], add_generation_prompt: bool = False) -> str:
        """The conversation as text (what `apply_chat_template(..., tokenize=False)` gives)."""
        return self._run(messages, add_generation_prompt, None)

    def assistant_spans(self, messages: Sequence[Mapping], rendered: str) -> list[tuple[int, int]]:
        """[start, end) character spans of `rendered` (the conversation's `render`) that the
        assistant's turns fill: by `{% generation %}` markers, else turn by turn (module doc)."""
        if self.has_generation_markers:
            spans: list[tuple[int, int]] = []
            self._run(messages, False, spans)
            return spans
        spans = []
        for turn, message in enumerate(messages):
            if message.get("role") == "assistant":
                spans.append(self.completion_span(messages[:turn], messages[: turn + 1], rendered))
        return spans

    def completion_span(self, prompt, through, rendered: str) -> tuple[int, int]:
        """The span of `rendered` after `prompt` rendered with the generation prompt, to the end
        of `through` (prompt and what follows it) rendered; a RenderError unless both renderings
        begin `rendered`."""
        start, end = self.render(prompt, add_generation_prompt=True), self.render(through)
        for part in (start, end):
            if not rendered.startswith(part):
                raise RenderError(
                    f"the template renders the conversation up to turn {len(through) - 1} "
                    "otherwise than the start of the whole conversation (it rewrites earlier "
                    "turns), so the assistant's tokens cannot be told apart; use a template with "
                    "{% generation %} markers, or data.loss_on=all"
                )
        return len(start), len(end)

    def _run(self, messages, add_generation_prompt: bool, spans: list | None) -> str:
        messages = [_plain_message(message) for message in messages]
        variables = {
            **self.special_tokens,
            "messages": messages,
            "tools": None,
            "documents": None,
            "add_generation_prompt": add_generation_prompt,
        }
        blocks: list[str] = []
        environment = self.compiled.environment
        try:
            with environment.tracking_generation(blocks, spans):
                for block in self.compiled.generate(**variables):
                    blocks.append(block)
        except Exception as e:  # its raise_exception, or its own code failing on these messages
            raise RenderError(f"{type(e).__name__}: {first_line(e)}") from None
        return "".join(blocks)


def _plain_message(message: Mapping) -> dict:
    """A message as transformers hands it to a template: keys whose value is None dropped, the
    reasoning under each of its names."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def load_chat_template(tokenizer_path: str) -> ChatTemplate:
    """The chat template of the tokenizer at `tokenizer_path` (its directory, or its
    tokenizer.json); a DataError in one line if it has none or it is not valid Jinja."""
    path = os.path.expanduser(tokenizer_path)
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config = _read_config(os.path.join(folder, CONFIG_FILE))
    template_file = os.path.join(folder, TEMPLATE_FILE)
    if os.path.isfile(template_file):  # transformers prefers it to the config's entry
        with open(template_file, encoding="utf-8") as f:
            source, where = f.read(), template_file
    else:
        where = os.path.join(folder, CONFIG_FILE)
        source = _configured_template(config.get("chat_template"), where)
    special_tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        token = config.get(key)
        token = token.get("content") if isinstance(token, Mapping) else token
        if isinstance(token, str):
            special_tokens[key] = token
    try:
        compiled = _environment().from_string(source)
    except Exception as e:  # jinja2.TemplateSyntaxError, with its line
        line = getattr(e, "lineno", None)
        at = f" (line {line})" if line else ""
        raise DataError(
            f"the chat template of {where} is not valid Jinja{at}: {first_line(e)}; fix the "
            "template"
        ) from None
    return ChatTemplate(source, where, special_tokens, compiled)


def _read_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not readable JSON ({first_line(e)}); fix it") from None
    return config if isinstance(config, dict) else {}


def _configured_template(entry, where: str) -> str:
    """tokenizer_config.json's `chat_template`: a string, or [{name, template}, ...] whose
    `default` transformers takes."""
    if isinstance(entry, list):
        named = {t.get("name"): t.get("template") for t in entry if isinstance(t, Mapping)}
        entry = named.get("default")
    if not isinstance(entry, str) or not entry.strip():
        raise DataError(
            f"{where} has no chat_template (nor is there a {TEMPLATE_FILE} beside it), which chat "
            "messages are rendered with; use the tokenizer of a chat (instruct) model, or write "
            "the data as prompt/completion strings"
        )
    return entry


@functools.cache
def _environment():
    """The Jinja environment transformers renders chat templates in (one per process)."""
    import datetime

    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: while tracking, records where its output
        lands in the rendered text."""

        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(tracking_generation=self.tracking)
            self._tracked: tuple[list, list | None] | None = None

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            call = self.call_method("_generation")
            return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

        def _generation(self, caller):
            text = caller()
            if self._tracked is not None and self._tracked[1] is not None:
                blocks, spans = self._tracked
                start = len("".join(blocks))
                spans.append((start, start + len(text)))
            return text

        def tracking(self, blocks: list, spans: list | None):
            extension = self

            class Tracking:
                def __enter__(self):
                    extension._tracked = (blocks, spans)

                def __exit__(self, *exc):
                    extension._tracked = None

            return Tracking()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; transformers' does not
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(format):
        return datetime.datetime.now().strftime(format)

    class TemplateDict:  # `dict(...)` without access to the type itself
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):  # no underscore attributes
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot set underscore attributes on a namespace ({name!r})"
                )

    environment = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = tojson
    environment.globals.update(
        raise_exception=raise_exception,
        strftime_now=strftime_now,
        dict=TemplateDict(),
        namespace=TemplateNamespace,
    )
    return environment
