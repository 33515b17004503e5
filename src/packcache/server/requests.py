"""The request bodies ``packcache serve`` takes: one declared model per route, in which every field is served or
refused by name.

* :class:`EmbeddingsRequest`: OpenAI's ``POST /v1/embeddings``;
* :class:`TEIEmbedRequest`: TEI's ``POST /embed {"inputs": ...}``;
* :class:`TextsRequest`: this server's own ``POST /embed {"texts": [...]}``;
* :class:`ChatRequest`: OpenAI's ``POST /v1/chat/completions``;
* :class:`CompletionRequest`: OpenAI's ``POST /v1/completions``.

A body is read by :func:`packcache._boundedjson.loads` first (depth, integer size, duplicate keys, no NaN), then
validated by its route's model (:func:`parse`) with pydantic: unknown fields are refused, JSON's types are taken
strictly (no ``"1"`` for ``1``, no ``true`` for ``1``), every bound the server enforces is declared beside its
field, and the ones that depend on the server's options and model (how many texts, the served name, the model's
width, the generation bound, the vocabulary) come from the :class:`Bounds` the application passes. A field that
OpenAI has and this server does not serve accepts only the value that means "not asked for" (:class:`Unserved`).

:meth:`Body.refusal` is the one translator from pydantic's ``ValidationError`` to a
:class:`~packcache.server.wsgiapp.Refusal` in the route's API: its status, its words, OpenAI's ``param`` naming
the field. Each model says how its API words an unknown field, a missing one and a body that is no object.
The models' JSON schemas (``model_json_schema()``) describe what each route accepts; the fuzz test generates
requests from them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, TypeVar, cast

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    ValidationError,
    ValidationInfo,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

from .wsgiapp import Refusal

__all__ = ["MAX_MESSAGES", "MAX_STOPS", "MAX_STOP_CHARS", "Body", "Bounds", "ChatRequest", "CompletionRequest",
           "EmbeddingsRequest", "TEIEmbedRequest", "TextsRequest", "parse"]  # fmt: skip

MAX_STOPS = 4
MAX_STOP_CHARS = 256
MAX_MESSAGES = 1024
#: The seeds a request may give: OpenAI's signed 64-bit range and the unsigned one (each its own stream).
SEED_LOW, SEED_HIGH = -(2**63), 2**64


@dataclass(frozen=True)
class Bounds:
    """What the server lets one request ask for, from its options and its model.

    Attributes:
        model_id: the served name (``GET /v1/models``): a request's ``model`` must be it or absent.
        max_texts, max_text_chars: texts per embedding request, characters per text (:class:`~.wsgiapp.Limits`).
        dimension: the embedding model's width (``dimensions`` is at most it); 0 for a causal LM.
        prompts: the embedding model's prompt names (TEI's ``prompt_name``).
        max_tokens: the most tokens one generation request may ask for (:class:`~.completions.Generation`).
        vocab_size: the causal LM's vocabulary (a token-id prompt's ids are below it); 0 for an embedding model.
    """

    model_id: str
    max_texts: int
    max_text_chars: int
    dimension: int
    prompts: frozenset[str]
    max_tokens: int
    vocab_size: int


B = TypeVar("B", bound="Body")


def parse(model: type[B], body: Any, bounds: Bounds) -> B:
    """``body`` (parsed JSON) validated as ``model`` under ``bounds``.

    Raises:
        Refusal: the first problem, in ``model``'s API (:meth:`Body.refusal`).
    """
    try:
        return model.model_validate(body, context={"bounds": bounds})
    except ValidationError as exc:
        raise model.refusal(exc, body) from None


# ---------------------------------------------------------------- refusals in a field's own words


def refused(
    message: str, *, status: int | None = None, code: str | None = None, param: str | None = None
) -> PydanticCustomError:
    """A refusal worded by its field: ``status`` and ``code`` (OpenAI's ``code``, TEI's ``error_type``) replace the
    route's defaults, ``param`` names the field when the error is not at one (a check across fields)."""
    context = {"message": message, "status": status, "code": code, "param": param}
    return PydanticCustomError("refused", "{message}", context)


def _bounds(info: ValidationInfo) -> Bounds | None:
    context = info.context
    bounds = context.get("bounds") if isinstance(context, dict) else None
    return bounds if isinstance(bounds, Bounds) else None


def shown(value: Any) -> str:
    """``value`` in a message: a scalar as JSON writes it (at most 40 characters), a container by its kind.

    >>> shown(True), shown(2.5), shown("abc"), shown([1]), shown({"a": 1})
    ('true', '2.5', "'abc'", 'a list', 'an object')
    """
    if value is None or isinstance(value, bool):
        return "null" if value is None else "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(value)[:40]
    if isinstance(value, str):
        return repr(value[:40])
    return "a list" if isinstance(value, list) else "an object" if isinstance(value, dict) else type(value).__name__


def worded(word: Callable[[Any, Bounds | None], str]) -> WrapValidator:
    """The field's type and bounds, refused in ``word(value, bounds)``'s words; a refusal of its own stands."""

    def wrap(value: Any, handler: ValidatorFunctionWrapHandler, info: ValidationInfo) -> Any:
        try:
            return handler(value)
        except ValidationError as exc:
            if any(error["type"] == "refused" for error in exc.errors(include_url=False, include_input=False)):
                raise
            raise refused(word(value, _bounds(info))) from None

    return WrapValidator(wrap)


def _said(message: str) -> WrapValidator:
    return worded(lambda value, bounds: message)


def _unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


@dataclass(frozen=True)
class Unserved:
    """A field this server does not serve: only the values in ``served`` pass (equal and of the same JSON type, so
    ``false`` is not ``0``); any other is refused by name. ``why`` says what the server does instead."""

    served: tuple[Any, ...]
    why: str = ""

    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        return core_schema.with_info_plain_validator_function(self._check)

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> dict[str, Any]:
        enum: list[Any] = []  # JSON's values: 0 and 0.0 are one
        for value in self.served:
            if not any(value == seen and isinstance(value, bool) == isinstance(seen, bool) for seen in enum):
                enum.append(value)
        return {"enum": enum}

    def _check(self, value: Any, info: ValidationInfo) -> Any:
        if any(value == served and type(value) is type(served) for served in self.served):
            return value
        default = next((s for s in self.served if s is not None), None)
        why = self.why or f"only its default: {default!r}"
        raise refused(f"'{info.field_name}' is not served by this server ({why})")


# ---------------------------------------------------------------- the base: unknown fields, strict JSON types


class Body(BaseModel):
    """A request body: unknown fields refused, JSON's types strictly. A subclass names its API's defaults
    (``status``, ``kind``) and words an unknown field, a missing one and a body that is no object
    (:meth:`framing`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    status: ClassVar[int] = 400
    kind: ClassVar[str | None] = None

    @classmethod
    def framing(cls, problem: str, name: str, body: Any) -> Refusal:
        """The refusal of an unknown field ``name`` (``problem`` ``"unknown"``), a missing one (``"missing"``) or a
        body that is not an object (``"object"``), as OpenAI words them."""
        if problem == "unknown":
            return Refusal(400, f"Unrecognized request argument supplied: {name[:40]}", param=name[:40])
        if problem == "missing":
            return Refusal(400, f"'{name}' is a required property", param=name)
        return Refusal(400, f"the body must be a JSON object, not {_json_type(body)}")

    @classmethod
    def refusal(cls, exc: ValidationError, body: Any) -> Refusal:
        """The first problem of ``exc`` (an unknown field first, as OpenAI reports it) as a :class:`Refusal` of this
        route's API: the one translator from pydantic's errors to the API's."""
        errors = exc.errors(include_url=False, include_input=False)
        unknown = [e for e in errors if e["type"] == "extra_forbidden" and len(e["loc"]) == 1]
        error = unknown[0] if unknown else errors[0]
        loc, kind = error["loc"], error["type"]
        field = str(loc[0]) if loc else None
        if kind == "extra_forbidden" and field is not None and len(loc) == 1:
            return cls.framing("unknown", field, body)
        if kind == "missing" and field is not None and len(loc) == 1:
            return cls.framing("missing", field, body)
        if not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
            return cls.framing("object", "", body)
        context = error.get("ctx") or {}
        if kind == "refused":
            return Refusal(context.get("status") or cls.status, str(context.get("message")),
                           param=context.get("param") or field, kind=context.get("code") or cls.kind)  # fmt: skip
        return Refusal(cls.status, f"'{_path(loc)}': {error['msg']}", param=field, kind=cls.kind)


def _path(loc: tuple[int | str, ...]) -> str:
    """``("messages", 0, "content")`` as ``messages[0].content``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _json_type(value: Any) -> str:
    names = {list: "array", str: "string", bool: "boolean", int: "number", float: "number", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def _model(value: Any, info: ValidationInfo) -> Any:
    """``model``: the served name or absent (404 ``model_not_found`` otherwise, as OpenAI and vLLM answer)."""
    bounds = _bounds(info)
    if value is not None and bounds is not None and value != bounds.model_id:
        served = f"this server serves {bounds.model_id!r} (GET /v1/models)"
        raise refused(f"The model {value[:100]!r} does not exist: {served}", status=404, code="model_not_found")
    return value


ModelName = Annotated[str | None, _said("'model' must be a string")]
User = Annotated[str | None, _said("'user' must be a string")]


def _check_texts(texts: list[str], bounds: Bounds | None, *, over: int) -> None:
    """Each text within ``max_text_chars`` (else ``over``) and encodable as UTF-8 (else 400, or 422 on TEI's)."""
    if bounds is None:
        return
    for index, text in enumerate(texts):
        if len(text) > bounds.max_text_chars:
            raise refused(f"text {index} has {len(text)} characters; at most {bounds.max_text_chars}", status=over)
        if not _unicode(text):
            raise refused(f"text {index} is not valid Unicode (a lone surrogate)", status=over if over == 400 else 422)


# ---------------------------------------------------------------- the embedding routes


class EmbeddingsRequest(Body):
    """OpenAI's ``POST /v1/embeddings``: texts only (token ids refused), at most ``max_texts``, none empty."""

    model: ModelName = None
    input: Annotated[
        str | list[str] | list[int] | list[list[int]], _said("'input' must be a string or a list of strings")
    ]
    encoding_format: Annotated[
        Literal["float", "base64"],
        worded(lambda value, bounds: f"'encoding_format' must be 'float' or 'base64', not {shown(value)}"),
    ] = "float"
    dimensions: Annotated[
        int | None,
        worded(lambda value, bounds: f"'dimensions' must be an integer from 1 to the model's "
                                     f"{bounds.dimension if bounds else 'width'}, not {shown(value)}"),
    ] = None  # fmt: skip
    user: User = None

    _check_model = field_validator("model")(_model)

    @field_validator("input")
    @classmethod
    def _input(cls, value: Any, info: ValidationInfo) -> Any:
        texts = [value] if isinstance(value, str) else value
        if texts and all(isinstance(t, (int, list)) for t in texts):
            raise refused("token-id input is not served: send the text (a string or a list of strings)")
        if not texts:
            raise refused("'input' must not be an empty list")
        if any(not t for t in texts):
            raise refused("'input' must not contain an empty string")
        bounds = _bounds(info)
        if bounds is not None and len(texts) > bounds.max_texts:
            raise refused(f"{len(texts)} inputs; at most {bounds.max_texts} per request")
        _check_texts(texts, bounds, over=400)
        return value

    @field_validator("dimensions")
    @classmethod
    def _dimensions(cls, value: int | None, info: ValidationInfo) -> int | None:
        bounds = _bounds(info)
        width = bounds.dimension if bounds is not None else None
        if value is not None and (value < 1 or (width is not None and value > width)):
            raise refused(f"'dimensions' must be an integer from 1 to the model's {width}, not {value}")
        return value

    @property
    def texts(self) -> list[str]:
        """The texts (a lone string as a list of one)."""
        return [self.input] if isinstance(self.input, str) else cast("list[str]", list(self.input))


class TEIEmbedRequest(Body):
    """TEI's ``POST /embed {"inputs": ...}``: its fields, its error shape and codes (422 ``Validation``; 413 for too
    many texts or a text too long; 400 ``Empty``)."""

    status: ClassVar[int] = 422
    kind: ClassVar[str | None] = "Validation"

    inputs: Annotated[
        str | list[str], _said("`inputs` must be a string or a list of strings (token ids are not served)")
    ]
    normalize: Annotated[bool | None, _said("`normalize` must be true or false")] = None
    truncate: Annotated[bool | None, _said("`truncate` must be true or false")] = None
    truncation_direction: Annotated[
        Literal["Right", "right"] | None,
        _said('`truncation_direction` must be "Right": this server truncates the end of a text'),
    ] = None
    prompt_name: Annotated[str | None, _said("`prompt_name` must be a string or null")] = None

    @classmethod
    def framing(cls, problem: str, name: str, body: Any) -> Refusal:
        if problem == "unknown":
            fields = ", ".join(sorted(cls.model_fields))
            return Refusal(422, f"unknown field {name[:40]!r}: TEI's /embed takes {fields}", kind="Validation")
        if problem == "missing":
            return Refusal(422, f"missing field `{name}`", kind="Validation")
        return Refusal(422, f"the body must be a JSON object, not {_json_type(body)}", kind="Validation")

    @field_validator("inputs")
    @classmethod
    def _inputs(cls, value: str | list[str], info: ValidationInfo) -> str | list[str]:
        texts = [value] if isinstance(value, str) else value
        if not texts:
            raise refused("`inputs` cannot be empty", status=400, code="Empty")
        bounds = _bounds(info)
        if bounds is not None and len(texts) > bounds.max_texts:
            raise refused(f"batch size {len(texts)} > maximum allowed batch size {bounds.max_texts}", status=413)
        _check_texts(texts, bounds, over=413)
        return value

    @field_validator("prompt_name")
    @classmethod
    def _prompt_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        bounds = _bounds(info)
        if value is not None and bounds is not None and value not in bounds.prompts:
            known = ", ".join(sorted(bounds.prompts)) or "none"
            raise refused(f"prompt {value[:40]!r} is not one of the model's prompts ({known})")
        return value

    @property
    def texts(self) -> list[str]:
        return [self.inputs] if isinstance(self.inputs, str) else list(self.inputs)


class TextsRequest(Body):
    """This server's own ``POST /embed {"texts": [...]}``: exactly that key, a list of strings (empty allowed)."""

    texts: Annotated[list[str], _said('"texts" must be a list of strings')]

    @classmethod
    def framing(cls, problem: str, name: str, body: Any) -> Refusal:
        keys = [key[:40] for key in sorted(body)[:5]] if isinstance(body, dict) else None
        return Refusal(400, f'expected an object with exactly the key "texts", got {keys or _json_type(body)}')

    @field_validator("texts")
    @classmethod
    def _texts(cls, value: list[str], info: ValidationInfo) -> list[str]:
        bounds = _bounds(info)
        if bounds is not None and len(value) > bounds.max_texts:
            raise refused(f"{len(value)} texts; at most {bounds.max_texts} per request")
        _check_texts(value, bounds, over=400)
        return value


# ---------------------------------------------------------------- the generation routes


def _max_tokens(value: Any, info: ValidationInfo) -> Any:
    bounds = _bounds(info)
    if value is not None and (value < 1 or (bounds is not None and value > bounds.max_tokens)):
        limit = bounds.max_tokens if bounds is not None else "the bound"
        raise refused(f"'{info.field_name}' must be an integer from 1 to {limit}, not {value}")
    return value


def _max_tokens_word(name: str) -> WrapValidator:
    def word(value: Any, bounds: Bounds | None) -> str:
        return (
            f"'{name}' must be an integer from 1 to {bounds.max_tokens if bounds else 'the bound'}, not {shown(value)}"
        )

    return worded(word)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a last chunk with the usage and no choices, as OpenAI sends it) and
    ``continuous_usage_stats`` (the usage so far in every chunk, as vLLM sends it)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_CHARS)]


class _Generate(Body):
    """The fields both generation routes take."""

    model: ModelName = None
    max_tokens: Annotated[int | None, _max_tokens_word("max_tokens")] = None
    temperature: Annotated[
        float | None,
        Field(ge=0, le=2),
        worded(lambda v, b: f"'temperature' must be a number in [0, 2], not {shown(v)}"),
    ] = None
    top_p: Annotated[
        float | None, Field(gt=0, le=1), worded(lambda v, b: f"'top_p' must be a number in (0, 1], not {shown(v)}")
    ] = None
    stop: Annotated[
        Stop | Annotated[list[Stop], Field(max_length=MAX_STOPS)] | None,
        _said(f"'stop' must be a string or a list of at most {MAX_STOPS} non-empty strings of at most "
              f"{MAX_STOP_CHARS} characters"),
    ] = None  # fmt: skip
    seed: Annotated[
        int | None, Field(ge=SEED_LOW, lt=SEED_HIGH), _said("'seed' must be a 64-bit integer (-2**63 to 2**64 - 1)")
    ] = None
    stream: Annotated[bool | None, _said("'stream' must be true or false")] = None
    stream_options: Annotated[
        StreamOptions | None,
        _said("'stream_options' must be an object with 'include_usage' and 'continuous_usage_stats', each true or "
              "false"),
    ] = None  # fmt: skip
    user: User = None
    n: Annotated[Any, Unserved((1, None), "one choice per request")] = None
    presence_penalty: Annotated[Any, Unserved((0, 0.0, None))] = None
    frequency_penalty: Annotated[Any, Unserved((0, 0.0, None))] = None
    logit_bias: Annotated[Any, Unserved((None, {}))] = None
    logprobs: Annotated[Any, Unserved((None, False))] = None

    _check_model = field_validator("model")(_model)
    _check_max_tokens = field_validator("max_tokens")(_max_tokens)

    @model_validator(mode="after")
    def _streamed(self) -> _Generate:
        if self.stream_options is not None and self.stream is not True:
            raise refused("'stream_options' is only allowed when 'stream' is true", param="stream_options")
        return self

    @property
    def stops(self) -> tuple[str, ...]:
        stop = self.stop
        return () if stop is None else (stop,) if isinstance(stop, str) else tuple(stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage is True

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats is True


class TextPart(BaseModel):
    """A part of a chat message's content: only text is served."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    """One chat message: its ``role``, its ``content`` (a string or text parts) and an optional ``name``, which the
    model's chat template must use (:meth:`~packcache.server.llm.LLMEngine.chat_prompt`)."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    role: str
    content: str | list[TextPart]
    name: str | None = None

    @property
    def text(self) -> str:
        content = self.content
        return content if isinstance(content, str) else "".join(part.text for part in content)


def _messages(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """``messages`` refused in words that name the message and the part (``messages[2].content``)."""
    shape = '\'messages\' must be a non-empty list of {"role", "content"} objects'
    if not isinstance(value, list) or not value:
        raise refused(shape)
    if len(value) > MAX_MESSAGES:
        raise refused(f"{len(value)} messages; at most {MAX_MESSAGES}")
    try:
        messages = handler(value)
    except ValidationError as exc:
        error = exc.errors(include_url=False, include_input=False)[0]
        loc = error["loc"]
        index = loc[0] if loc and isinstance(loc[0], int) else 0
        part = loc[1] if len(loc) > 1 else None
        if error["type"] == "extra_forbidden" and len(loc) == 2:
            raise refused(f"messages[{index}] has {str(part)[:40]!r}: only role, content and name are served") from None
        if part == "content":
            raise refused(f"messages[{index}].content must be a string or a list of text parts (only text is "
                          "served)") from None  # fmt: skip
        if part == "name":
            raise refused(f"messages[{index}].name must be a string") from None
        raise refused(f"messages[{index}] must be an object with a string 'role'") from None
    for index, message in enumerate(messages):
        for what, text in (("role", message.role), ("content", message.text), ("name", message.name or "")):
            if not _unicode(text):
                raise refused(f"messages[{index}].{what} is not valid Unicode (a lone surrogate)")
    return messages


class ChatRequest(_Generate):
    """OpenAI's ``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES), WrapValidator(_messages)]
    max_completion_tokens: Annotated[int | None, _max_tokens_word("max_completion_tokens")] = None
    response_format: Annotated[
        Any, Unserved((None, {"type": "text"}), "it generates free text, never constrained to JSON: only "
                                                "{'type': 'text'}")
    ] = None  # fmt: skip
    top_logprobs: Annotated[Any, Unserved((None, 0))] = None
    tools: Annotated[Any, Unserved((None, []))] = None
    tool_choice: Annotated[Any, Unserved((None, "none"))] = None
    parallel_tool_calls: Annotated[Any, Unserved((None,), "no tools")] = None

    _check_completion_tokens = field_validator("max_completion_tokens")(_max_tokens)

    @model_validator(mode="after")
    def _one_bound(self) -> ChatRequest:
        both = self.max_tokens is not None and self.max_completion_tokens is not None
        if both and self.max_tokens != self.max_completion_tokens:
            raise refused("'max_tokens' and 'max_completion_tokens' differ: send one of them",
                          param="max_completion_tokens")  # fmt: skip
        return self

    @property
    def asked_tokens(self) -> tuple[str, int] | None:
        """The field that bounds the completion and its value, if either was sent."""
        if self.max_completion_tokens is not None:
            return "max_completion_tokens", self.max_completion_tokens
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)


class CompletionRequest(_Generate):
    """OpenAI's ``POST /v1/completions``: one prompt (a string, a list of one string, or token ids)."""

    prompt: Annotated[
        str | list[str] | list[int] | list[list[int]],
        _said("'prompt' must be a string, a list of one string, or a list of token ids (one prompt per request)"),
    ]
    echo: Annotated[Any, Unserved((None, False))] = None
    best_of: Annotated[Any, Unserved((None, 1))] = None
    suffix: Annotated[Any, Unserved((None, ""))] = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, value: Any, info: ValidationInfo) -> Any:
        prompt = (
            value[0] if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)) else value
        )
        if isinstance(prompt, str):
            if not _unicode(prompt):
                raise refused("'prompt' is not valid Unicode (a lone surrogate)")
            return prompt
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            bounds = _bounds(info)
            vocabulary = bounds.vocab_size if bounds is not None else None
            if any(t < 0 or (vocabulary is not None and t >= vocabulary) for t in prompt):
                raise refused(f"token ids must be in [0, {vocabulary})")
            return prompt
        raise refused(
            "'prompt' must be a string, a list of one string, or a list of token ids (one prompt per request)"
        )

    @property
    def asked_tokens(self) -> tuple[str, int] | None:
        return None if self.max_tokens is None else ("max_tokens", self.max_tokens)
