"""A chat template is code that comes with the model file: one that would
take memory or time without end is stopped with a ModelFormatError, each
within a few seconds and a few MiB, while real templates render exactly as
transformers' environment renders them (docs/security.md, "Model files")."""

from __future__ import annotations

import json
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from pmetal.errors import PMetalValueError
from pmetal.pipeline.chat_template import (
    MAX_TEMPLATE_ITERATIONS,
    MAX_TEMPLATE_OUTPUT,
    MAX_TEMPLATE_RANGE,
    MAX_TEMPLATE_SECONDS,
    ChatTemplate,
)
from pmetal.pipeline.models import ModelFormatError
from pmetal.pipeline.tokenizer import Tokenizer
from tests.pipeline.tinymodel import CHAT_TEMPLATE, tiny_config, write_tiny_hf

# SmolLM2-135M-Instruct's template, as its GGUF file holds it (the default
# model; tests/pipeline/test_default_model.py renders it from the file).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}")

# What the templates of other model families use (Llama 3, Qwen, Mistral):
# namespace, loop variables, slices, filters, tests, macros, recursive loops.
FEATURES_TEMPLATE = (
    "{% set ns = namespace(system='', n=0) %}"
    "{% if messages and messages[0].role == 'system' %}{% set ns.system = messages[0].content|trim %}"
    "{% set rest = messages[1:] %}{% else %}{% set rest = messages %}{% endif %}"
    "{% macro turn(m) %}[{{ m.role|upper }}:{{ m.content }}]{% endmacro %}"
    "<<{{ ns.system }}>>{{ rest|selectattr('role', 'equalto', 'user')|list|length }}"
    "{% for m in rest if m.role != 'tool' %}{% set ns.n = ns.n + 1 %}{{ loop.index0 }}/"
    "{{ loop.length }}{{ turn(m) }}{% if loop.last %}!{% endif %}"
    "{% if m.content.startswith('{') %}{% break %}{% endif %}{% else %}(none){% endfor %}"
    "{{ ns.n }}{% for k, v in {'a': 1}.items() %}{{ k }}={{ v }}{% endfor %}"
    "{% for t in [[1, [2, 3]], 4] recursive %}{% if t is iterable %}({{ loop(t) }})"
    "{% else %}{{ t }}{{ loop.cycle(',', ';') }}{% endif %}{% endfor %}"
    "{% if tools is defined %}{{ tools }}{% endif %}{{ bos_token ~ eos_token }}")

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo 日本 🤖"},
     {"role": "assistant", "content": "Hi."}, {"role": "user", "content": "{{ not code }}"}],
    [],
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("templates")
    write_tiny_hf(path, tiny_config())
    return path


def tokenizer_with(folder: Path, template: str) -> Tokenizer:
    settings_file = folder / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text())
    settings_file.write_text(json.dumps({**settings, "chat_template": template}))
    return Tokenizer.from_hf_folder(folder)


@pytest.fixture
def bounded() -> Iterator[None]:
    """The test's body must finish in 5 s and 64 MiB (numpy and str buffers
    alike: tracemalloc sees every Python allocation)."""
    tracemalloc.start()
    started = time.monotonic()
    yield
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert time.monotonic() - started < 5.0
    assert peak < 64 << 20, f"peak {peak >> 20} MiB"


@pytest.mark.parametrize("template", [SMOLLM2_TEMPLATE, CHAT_TEMPLATE, FEATURES_TEMPLATE],
                         ids=["smollm2", "tiny", "features"])
@pytest.mark.parametrize("conversation", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_real_templates_render_as_transformers_renders_them(
        template: str, conversation: list[dict[str, str]], add_generation_prompt: bool) -> None:
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    plain = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                          extensions=[loopcontrols])
    plain.globals["raise_exception"] = lambda message: None
    variables = {"add_generation_prompt": add_generation_prompt, "bos_token": "<s>",
                 "eos_token": "</s>"}
    expected = plain.from_string(template).render(messages=conversation, **variables)
    assert ChatTemplate(template).render(conversation, **variables) == expected


def test_a_conversation_longer_than_the_output_limit_still_renders(folder: Path) -> None:
    """The limit counts what the template adds: the user's own text is theirs."""
    tok = tokenizer_with(folder, SMOLLM2_TEMPLATE)
    long = "word " * (MAX_TEMPLATE_OUTPUT // 2)
    text = tok.apply_chat_template([{"role": "user", "content": long}] * 2)
    assert text.count(long) == 2


SLOW = f"it ran longer than {MAX_TEMPLATE_SECONDS} s"
# Which of the loop budget and the deadline stops a silent loop first depends
# on the machine (and on tracemalloc, which slows every allocation).
ATTACKS = {
    # one binop that would allocate 2 GiB before any output
    "string repetition": ("{{ 'A' * 2**31 }}", "a repetition would make 2,147,483,648"),
    "list repetition": ("{% set l = [1, 2] * 2**40 %}{{ l|length }}", "a repetition"),
    "doubling": ("{% set s = 'ab' * 500000 %}{{ s + s + s }}", "a concatenation"),
    "power": ("{{ 7 ** (10**9) }}", "has more than 65536 bits"),  # ** is left-associative
    "product": ("{% set n = 2**30000 %}{{ n * n * n }}", "a product of more than 65536 bits"),
    "percent width": ("{{ '%0999999999d' % 1 }}", "a format would make"),
    "percent star": ("{{ '%*d' % (999999999, 1) }}", "takes its width from its arguments"),
    "format width": ("{{ '{:>999999999}'.format(1) }}", "a format would make"),
    "format filter": ("{{ '%999999999s'|format('x') }}", "a format would make"),
    "ljust": ("{{ 'a'.ljust(2**31) }}", r"ljust\(\) with an argument of 2,147,483,648"),
    "center filter": ("{{ 'x'|center(10**9) }}", r"center\(\) with an argument"),
    "tojson indent": ("{{ messages|tojson(indent=10**9) }}", r"tojson\(\) with an argument"),
    "slice filter": ("{{ [1]|slice(10**9)|list }}", r"slice\(\) with an argument"),
    "replace": ("{% set s = 'x' * 1000000 %}{{ s.replace('x', 'yy') }}", r"replace\(\)"),
    "replace filter": ("{% set s = 'x' * 2000 %}{{ s|replace('x', s) }}", r"replace\(\)"),
    "join": ("{% set s = 'x' * 1000000 %}{{ [s, s]|join }}", r"join\(\)"),
    "join method": ("{% set s = 'x' * 1000000 %}{{ s.join(['a', 'b']) }}", r"join\(\)"),
    "indent": ("{% set s = '\n' * 1000000 %}{{ s|indent(100) }}", r"indent\(\)"),
    "expandtabs": ("{% set s = '\t' * 1000000 %}{{ s.expandtabs(100) }}", r"expandtabs\(\)"),
    "range": (("{% for a in range(10**6) %}{% for b in range(10**6) %}x{% endfor %}"
               "{% endfor %}"), rf"range\(\) of 1,000,000 items, more than the limit of {MAX_TEMPLATE_RANGE:,}"),
    # loops within every single bound: the output limit, the loop budget, the deadline
    "output": (("{% for a in range(10000) %}{% for b in range(10000) %}xxxxxxxxxx{% endfor %}"
                "{% endfor %}"), r"its output would make 1,048,5\d\d characters"),
    "silent loops": (("{% for a in range(10000) %}{% for b in range(10000) %}{% endfor %}"
                      "{% endfor %}"), f"(more than {MAX_TEMPLATE_ITERATIONS:,} iterations|{SLOW})"),
    "silent list loops": (("{% set l = [0] * 100000 %}{% for a in l %}{% for b in l %}"
                           "{% endfor %}{% endfor %}"), f"(iterations|{SLOW})"),
    "set block": (("{% set s %}{% for a in range(10000) %}{% for b in range(10000) %}x"
                   "{% endfor %}{% endfor %}{% endset %}"), f"(iterations|{SLOW})"),
    "slow loop": ("{% for a in range(10000) %}{% set s = ('x' * 1000000)|upper %}{% endfor %}",
                  SLOW),
}


@pytest.mark.parametrize("name", ATTACKS)
def test_costly_templates_are_stopped_with_a_clear_error(folder: Path, name: str,
                                                         bounded: None) -> None:
    template, reason = ATTACKS[name]
    tok = tokenizer_with(folder, template)
    with pytest.raises(ModelFormatError, match=r"chat template is broken: it exceeds a "
                                               rf"resource limit: .*{reason}"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("template", [
    "{{ 1 / 0 }}", "{{ 'a' + 1 }}", "{{ 2.0 ** 100000 }}", "{{ messages.x.y }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "{{ 10**5000 }}",
    "{{ lipsum(n=1000000, min=100, max=100) }}",  # not there: 600 MB in one call
])
def test_templates_that_raise_are_broken_not_crashes(folder: Path, template: str,
                                                     bounded: None) -> None:
    with pytest.raises(ModelFormatError, match="chat template is broken"):
        tokenizer_with(folder, template).apply_chat_template([])


def test_raise_exception_still_refuses_the_messages(folder: Path) -> None:
    tok = tokenizer_with(folder, "{{ raise_exception('no system turns') }}")
    with pytest.raises(PMetalValueError, match="refused the messages: no system turns"):
        tok.apply_chat_template([])
