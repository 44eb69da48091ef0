// Chat templates: the Jinja interpreter in chat_template.hpp against Hugging Face's renderings in
// ../shared/chat (Python Jinja2 3.1.6 configured as transformers does), plus unit tests of the interpreter whose
// expected strings were produced by that same Jinja2 configuration.
#include "support.hpp"

#include "chat_template.hpp"

namespace {

infer::Json json(std::string_view text) { return infer::Json::parse(text, "test"); }

// Renders a template with no messages and `context` (a JSON object) as its variables.
std::string render(std::string_view source, std::string_view context = "{}") {
    return chat::render(source, json("[]"), false, json(context));
}

const char* conversation = R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                               {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}])";

}  // namespace

TEST_CASE("chat templates render every reference conversation as Hugging Face does") {
    REQUIRE_SHARED_OR_SKIP();
    std::filesystem::path root = test::shared_dir() / "chat";
    int families = 0;
    for (const auto& entry : std::filesystem::directory_iterator(root)) {
        if (!entry.is_directory()) continue;
        std::string family = entry.path().filename().string();
        std::string source = infer::read_text_file(entry.path() / "chat_template.jinja");
        infer::Json context = test::read_json(entry.path() / "render_context.json").at("variables");
        std::istringstream lines(infer::read_text_file(entry.path() / "chat_cases.jsonl"));
        int cases = 0;
        for (std::string line; std::getline(lines, line);) {
            if (line.empty()) continue;
            infer::Json row = json(line);
            bool add_generation_prompt = row.at("add_generation_prompt").as_bool();
            CAPTURE(family);
            std::string name = row.at("case").as_string() + (add_generation_prompt ? " (generation prompt)" : "");
            CAPTURE(name);
            std::string rendered;
            std::string error = test::error_of(
                [&] { rendered = chat::render(source, row.at("messages"), add_generation_prompt, context); });
            if (row.at("error").is_null()) {
                CHECK(error == "");
                CHECK(rendered == row.at("rendered").as_string());
            } else {
                CHECK(error == row.at("error").as_string());
            }
            ++cases;
        }
        MESSAGE(family << ": " << cases << " cases");
        CHECK(cases > 0);
        ++families;
    }
    CHECK(families >= 3);
}

TEST_CASE("whitespace control: - strips, trim_blocks eats one newline, lstrip_blocks eats indentation") {
    CHECK(render("a  {{- 'b' -}}  c") == "abc");
    CHECK(render("a  {%- if true -%}  b  {%- endif -%}  c") == "abc");
    CHECK(render("{% if true %}\nx\n{% endif %}\ny") == "x\ny");             // trim_blocks
    CHECK(render("  {% if true %}\n  x\n  {% endif %}\n{# c #}\n  {{ 1 }}\n") == "  x\n  1");  // lstrip_blocks
    CHECK(render("  {%+ if true %}x{% endif %}") == "  x");                  // `+` keeps the indentation
    CHECK(render("{% if true +%}\nx{% endif %}") == "\nx");                  // `+` keeps the newline
    CHECK(render("a {#- note -#} b") == "ab");
    CHECK(render("x\n") == "x");                                             // keep_trailing_newline=False
    CHECK(render("{{ 'a' }}\n{{ 'b' }}") == "a\nb");                         // no trim after }}
    CHECK(render("{% raw %}{{ not evaluated }}{% endraw %}") == "{{ not evaluated }}");
}

TEST_CASE("loops: loop variables, filters, else, break/continue, scoping") {
    CHECK(render("{% for x in xs %}{{ loop.index0 }}{{ loop.index }}{{ loop.first }}{{ loop.last }}{{ loop.length }};{% endfor %}",
                 R"({"xs": ["a", "b"]})") == "01TrueFalse2;12FalseTrue2;");
    CHECK(render("{% for x in [1, 2, 3, 4] if x is even %}{{ x }}{{ loop.length }} {% endfor %}") == "22 42 ");
    CHECK(render("{% for x in [] %}x{% else %}empty{% endfor %}") == "empty");
    CHECK(render("{% for x in [1, 2, 3, 4] %}{% if x == 2 %}{% continue %}{% endif %}{% if x == 4 %}{% break %}{% endif %}{{ x }}{% endfor %}") == "13");
    CHECK(render("{% for k, v in d.items() %}{{ k }}={{ v }} {% endfor %}", R"({"d": {"a": 1, "b": "x"}})") == "a=1 b=x ");
    CHECK(render("{% for x in [1,2] %}{{ loop.previtem }}|{{ loop.nextitem }} {% endfor %}") == "|2 1| ");
    CHECK(render("{% for x in [1,2,3] %}{{ loop.cycle('a', 'b') }}{% endfor %}") == "aba");
    // `set` inside a loop is forgotten after each iteration; a namespace carries state out.
    CHECK(render("{% set x = 5 %}{% for i in [1,2] %}[{{ x }}]{% set x = i %}{% endfor %}{{ x }}") == "[5][5]5");
    CHECK(render("{% set ns = namespace(total=0) %}{% for i in [1,2,3] %}{% set ns.total = ns.total + i %}{% endfor %}{{ ns.total }}") == "6");
    CHECK(render("{% if true %}{% set y = 1 %}{% endif %}{{ y }}") == "1");  // `if` is no scope
}

TEST_CASE("expressions: operators, precedence, literals, printing like Python") {
    CHECK(render("{{ 1 + 2 * 3 }} {{ 7 // 2 }} {{ -7 % 3 }} {{ 7 / 2 }} {{ 2 ** 10 }} {{ 'a' ~ 1 ~ none }}") == "7 3 2 3.5 1024 a1None");
    CHECK(render("{{ 1.0 }} {{ 1e20 }} {{ 1/3 }} {{ 0.00001 }} {{ [1, 'a', none, true] }} {{ {'a': 1} }}") ==
          "1.0 1e+20 0.3333333333333333 1e-05 [1, 'a', None, True] {'a': 1}");
    CHECK(render("{{ 'yes' if 'b' in 'abc' else 'no' }} {{ 2 not in [1, 2] }} {{ 'x' if false }}|") == "yes False |");
    CHECK(render("{{ xs|length - 1 }} {{ not true or true }} {{ 1 < 2 <= 2 }} {{ 'b' > 'a' }}", R"({"xs": [1, 2, 3]})") ==
          "2 True True True");
    CHECK(render("{{ none or 'fallback' }} {{ 0 and 1 }} {{ '\\u00e9\\n'|length }}") == "fallback 0 2");
    CHECK(render("{{ m.role }} {{ m['content'] }} {{ m.missing }}|{{ m.get('missing', 'd') }} {{ m.keys()|list }}",
                 R"({"m": {"role": "user", "content": "hi"}})") == "user hi |d ['role', 'content']");
}

TEST_CASE("slicing counts code points and follows Python's bounds") {
    CHECK(render("{{ xs[::-1] }} {{ xs[1:] }} {{ xs[:-1] }} {{ xs[::2] }} {{ xs[-1] }} {{ xs[10] }}|", R"({"xs": [1, 2, 3, 4]})") ==
          "[4, 3, 2, 1] [2, 3, 4] [1, 2, 3] [1, 3] 4 |");
    CHECK(render("{{ 'h\\u00e9llo'[::-1] }} {{ 'hello'[1:3] }} {{ 'hello'[-2:] }}") == "oll\u00e9h el lo");
}

TEST_CASE("tests: defined, none, string, mapping, iterable, number, sequence, boolean") {
    CHECK(render("{{ x is defined }} {{ y is defined }} {{ y is undefined }} {{ x is none }} {{ x is not none }}", R"({"x": null})") ==
          "True False True True False");
    CHECK(render("{{ 'a' is string }} {{ {} is mapping }} {{ [] is iterable }} {{ 1.5 is number }} {{ 1 is integer }} "
                 "{{ 'a' is sequence }} {{ false is false }} {{ 0 is false }} {{ 3 is odd }} {{ 9 is divisibleby 3 }}") ==
          "True True True True True True True False True True");
    CHECK(render("{{ y }}|{{ y|length }}|{% for i in y %}x{% endfor %}|{{ 'no' if y else 'falsy' }}") == "|0||falsy");
}

TEST_CASE("filters and methods") {
    CHECK(render("{{ '  a b  '|trim }}|{{ 'xxaxx'|trim('x') }}|{{ 'Ab'|upper }}{{ 'Ab'|lower }}|{{ [1,2]|first }}{{ [1,2]|last }}") ==
          "a b|a|ABab|12");
    CHECK(render("{{ ['a','b']|join(', ') }}|{{ y|default('d') }}|{{ ''|default('d', true) }}|{{ 'aXbX'|replace('X', '-') }}") ==
          "a, b|d|d|a-b-");
    CHECK(render("{{ 'ab'|list }} {% for k, v in {'k': 1}|items %}{{ k }}{{ v }}{% endfor %} {{ [3,1,2]|sort }} {{ [1,1,2]|unique|list }} {{ [{'n': 'a'}, {'n': 'b'}]|map(attribute='n')|join }}") ==
          "['a', 'b'] k1 [1, 2, 3] [1, 2] ab");
    CHECK(render("{{ ms|selectattr('role', 'equalto', 'user')|map(attribute='content')|join(',') }}",
                 R"({"ms": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}, {"role": "user", "content": "c"}]})") == "a,c");
    CHECK(render("{{ '<think>x</think>\\n\\nanswer'.split('</think>')[-1].lstrip('\\n') }}|{{ ' a  b '.split() }}|{{ 'a,b,c'.split(',', 1) }}") ==
          "answer|['a', 'b']|['a', 'b,c']");
    CHECK(render("{{ '\\nx\\n'.strip('\\n') }}|{{ 'xa'.rstrip('a') }}|{{ 'abc'.startswith('ab') }}{{ 'abc'.endswith(('x', 'c')) }}|{{ 'a b'.title() }}") ==
          "x|x|TrueTrue|A B");
}

TEST_CASE("tojson prints like json.dumps(ensure_ascii=False), with indent and sort_keys") {
    const char* tool = R"({"t": {"name": "get", "args": {"city": "Zürich", "n": 2, "x": 0.5, "ok": true, "none": null, "q": "a\"b</tag>\n"}, "e": [], "f": {}}})";
    CHECK(render("{{ t|tojson }}", tool) ==
          "{\"name\": \"get\", \"args\": {\"city\": \"Zürich\", \"n\": 2, \"x\": 0.5, \"ok\": true, \"none\": null, "
          "\"q\": \"a\\\"b</tag>\\n\"}, \"e\": [], \"f\": {}}");
    CHECK(render("{{ [1, {'b': 2, 'a': [3]}]|tojson(indent=2, sort_keys=true) }}") ==
          "[\n  1,\n  {\n    \"a\": [\n      3\n    ],\n    \"b\": 2\n  }\n]");
    CHECK(render("{{ 'é'|tojson(ensure_ascii=true) }}") == "\"\\u00e9\"");
}

TEST_CASE("macros, set blocks and string escapes") {
    CHECK(render("{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} {{ greet('B', punct='?') }}") ==
          "Hi A! Hi B?");
    CHECK(render("{% set block %}x{{ 1 + 1 }}{% endset %}[{{ block }}]") == "[x2]");
    CHECK(render("{{ \"it's\" }} {{ 'tab\\there' }} {{ 'a' 'b' }}") == "it's tab\there ab");
}

TEST_CASE("errors: raise_exception's message verbatim; unsupported constructs named") {
    CHECK(test::error_of([] { render("{{ raise_exception('Conversation roles must alternate!') }}"); }) ==
          "Conversation roles must alternate!");
    CHECK(test::error_of([] { render("line 1\n{{ x|frobnicate }}"); }) == "chat template, line 2: unknown filter 'frobnicate'");
    CHECK(test::error_of([] { render("{{ x is frobnicated }}"); }) == "chat template, line 1: unknown test 'frobnicated'");
    CHECK(test::error_of([] { render("{% include 'other.jinja' %}"); }) ==
          "chat template, line 1: unsupported statement '{% include %}'");
    CHECK(test::error_of([] { render("{{ 'a'.frobnicate() }}"); }) == "chat template, line 1: unsupported string method 'str.frobnicate'");
    CHECK(test::error_of([] { render("{{ foo.bar }}"); }) == "chat template, line 1: 'foo' is undefined");
    CHECK(test::error_of([] { render("{{ d.x.y }}", R"({"d": {}})"); }) == "chat template, line 1: 'dict object' has no attribute 'x'");
    CHECK(test::error_of([] { render("{% if true %}never closed"); }) ==
          "chat template, line 1: unexpected end of template, expected '{% elif %}'");
    CHECK(test::error_of([] { render("{{ 1 + }}"); }) == "chat template, line 1: unexpected '}}' in an expression");
    CHECK(test::error_of([] { chat::render("x", json("[]"), false, json("[1]")); }) ==
          "chat::render: extra_context must be a JSON object or null");
}

TEST_CASE("built-in templates render their documented formats") {
    CHECK(chat::builtin_template("no-such-format") == nullptr);

    REQUIRE(chat::builtin_template("chatml") != nullptr);
    CHECK(chat::render(chat::builtin_template("chatml"), json(conversation), true, infer::Json()) ==
          "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
          "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n");

    REQUIRE(chat::builtin_template("llama3") != nullptr);
    CHECK(chat::render(chat::builtin_template("llama3"), json(conversation), true, json(R"({"bos_token": "<|begin_of_text|>"})")) ==
          "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
          "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>"
          "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n");

    REQUIRE(chat::builtin_template("llama2") != nullptr);
    infer::Json tokens = json(R"({"bos_token": "<s>", "eos_token": "</s>"})");
    CHECK(chat::render(chat::builtin_template("llama2"), json(conversation), true, tokens) ==
          "<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] Bye [/INST]");
    CHECK(test::error_of([&] {
              chat::render(chat::builtin_template("llama2"), json(R"([{"role": "assistant", "content": "x"}])"), true, tokens);
          }) == "Conversation roles must alternate user/assistant/user/assistant/...");
}

TEST_CASE("the builtin llama3 template is the llama3-instruct reference template") {
    REQUIRE_SHARED_OR_SKIP();
    CHECK(infer::read_text_file(test::shared_dir() / "chat" / "llama3-instruct" / "chat_template.jinja") ==
          std::string(chat::builtin_template("llama3")));
}

// Templates come from model files: each of these once crashed, hung or escaped as a foreign exception.
TEST_CASE("hostile templates end in an infer::Error that names the limit, never a crash or a hang") {
    auto repeat = [](std::string_view piece, int times) {
        std::string out;
        for (int i = 0; i < times; ++i) out += piece;
        return out;
    };
    auto error_names = [](const std::string& error, std::string_view what) {
        INFO(error);
        CHECK(error.find(what) != std::string::npos);
    };
    // Stack: 20,000 nested ifs, 10,000 parentheses, a chain of `not`s and minus signs, a macro that calls itself.
    error_names(test::error_of([&] { render(repeat("{% if true %}", 20000) + "x" + repeat("{% endif %}", 20000)); }),
                "TemplateLimits::max_depth");
    error_names(test::error_of([&] { render("{{ " + repeat("(", 10000) + "1" + repeat(")", 10000) + " }}"); }), "max_depth");
    error_names(test::error_of([&] { render("{{ " + repeat("not ", 100000) + "1 }}"); }), "max_depth");
    error_names(test::error_of([&] { render("{{ " + repeat("-", 100000) + "1 }}"); }), "max_depth");
    error_names(test::error_of([] { render("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"); }), "max_depth");
    // Time: loops over loops run out of steps (a smaller budget keeps the test fast; the default is ~1 s of work).
    chat::TemplateLimits small;
    small.max_steps = 100000;
    error_names(test::error_of([&] {
                    chat::render("{% for i in range(1000000) %}{% for j in range(1000000) %}{% endfor %}{% endfor %}",
                                 json("[]"), false, json("{}"), small);
                }),
                "TemplateLimits::max_steps");
    // Memory: a string doubled in a loop, a string repeated 10^15 times, a list doubled, a huge indent.
    error_names(test::error_of([] {
                    render("{% set ns = namespace(s='ab') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}");
                }),
                "TemplateLimits::max_output");
    error_names(test::error_of([] { render("{{ 'a' * 10**15 }}"); }), "max_output");
    error_names(test::error_of([] {
                    render("{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}");
                }),
                "TemplateLimits::max_items");
    error_names(test::error_of([] { render("{{ 'a'|indent(10**12) }}"); }), "larger than 4096");
    // 64-bit integers: a literal too large, overflow in arithmetic, exact results where they fit.
    CHECK(test::error_of([] { render("{{ 99999999999999999999999 }}"); }) ==
          "chat template, line 1: integer literal 99999999999999999999999 does not fit in 64 bits");
    error_names(test::error_of([] { render("{{ 9223372036854775807 + 1 }}"); }), "integer overflow");
    error_names(test::error_of([] { render("{{ 2 ** 64 }}"); }), "integer overflow");
    error_names(test::error_of([] { render("{{ -9223372036854775807 - 1 - 1 }}"); }), "integer overflow");
    CHECK(render("{{ 2 ** 62 }} {{ 9007199254740993 + 0 }} {{ -7 // 2 }} {{ 7 % -3 }} {{ (-1) ** 5 }}") ==
          "4611686018427387904 9007199254740993 -4 -2 -1");
    CHECK(render("{{ range(9223372036854775806, 9223372036854775807, 5)|list }}") == "[9223372036854775806]");
}
