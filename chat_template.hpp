// chat_template.hpp — a small Jinja interpreter for Hugging Face chat templates.
//
// A chat model does not see "messages"; it sees one string in which each turn is wrapped in the special tokens it was
// trained on (`<|im_start|>user\n...<|im_end|>`, `<|start_header_id|>user<|end_header_id|>\n\n...`). Hugging Face
// ships the recipe for that string as a Jinja template (`chat_template` in tokenizer_config.json) and renders it with
// Python's Jinja2 configured the way `transformers` does:
//
//     ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
//     globals raise_exception(message), strftime_now(format); filter tojson = json.dumps(ensure_ascii=False)
//
// This header re-implements the part of Jinja that real chat templates use, so that `chat::render` returns the same
// bytes as `tokenizer.apply_chat_template(messages, tokenize=False)`. It is an ordinary tree-walking interpreter:
//
//     1. LEXER      template text -> tokens; all of Jinja's whitespace control happens here
//     2. VALUES     the dynamic values templates compute with (Python's None/bool/int/float/str/list/dict)
//     3. PARSER     tokens -> a tree of statements and expressions (recursive descent, Jinja's precedence)
//     4. EVALUATION walk the tree: scopes, filters, tests, string/dict methods, output
//     5. API        chat::render and the built-in templates
//
// Quick start:
//     #include "chat_template.hpp"
//     infer::Json messages = infer::Json::parse(R"([{"role": "user", "content": "Hello!"}])");
//     std::string prompt = chat::render(chat::builtin_template("chatml"), messages, true, infer::Json());
//     // "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
//
// Supported: `{{ }}`, `{% %}`, `{# #}` with `-`/`+` whitespace control, trim_blocks, lstrip_blocks, `{% raw %}`;
// statements if/elif/else, for (with `if` filter, `else`, tuple targets, `loop.*`), set (names, `ns.attr`, tuples,
// block set), macro (positional and keyword arguments with defaults), break/continue, generation (rendered as-is);
// expressions with Jinja's precedence: `x if c else y`, or/and/not, comparisons, `in`/`not in`, `is [not] test`,
// + - * / // % ** ~, literals (str/int/float/list/dict/tuple), attribute and item access, slicing `[a:b:c]`, calls;
// the filters, tests, methods and globals listed in section 4.
// Not supported: template inheritance and includes (extends/block/include/import), `{% call %}`, `{% filter %}`,
// `{% with %}`, recursive loops, `str.format` and the `%` string operator, HTML autoescape (transformers leaves it
// off), non-ASCII case mapping in upper/lower/title. Any of these is an infer::Error naming it, never a silent guess.
// One input difference: infer::Json keeps numbers as doubles, so a whole number in `messages` (`1.0` or `1`) becomes
// a Jinja int.

#pragma once

#include "infer.hpp"

#include <charconv>
#include <ctime>
#include <functional>
#include <map>
#include <memory>
#include <optional>

namespace chat {

// Chat templates ship inside model files, so they are untrusted input. These bounds keep a hostile template from
// exhausting the stack (20,000 nested `if`s, a macro that calls itself), a thread (loops over loops) or memory (a
// string doubled in a loop); real templates stay orders of magnitude below each. A breach is an infer::Error that
// names the limit, which the server answers with a 400.
struct TemplateLimits {
    int max_depth = 256;              // nested tags, parenthesized expressions and macro calls
    int64_t max_steps = 10'000'000;   // statements run + expressions evaluated + loop iterations (about a second)
    size_t max_output = 16u << 20;    // bytes of rendered text, and of any one string built on the way
    size_t max_items = 1'000'000;     // items in any one list (range() has the same bound)
};

namespace detail {

using infer::concat;

// Template errors carry the template line, so a broken template points at its own text.
template <class... Parts>
[[noreturn]] void fail_at(int line, const Parts&... parts) {
    throw infer::Error(concat("chat template, line ", line, ": ", parts...));
}

// Counts one level of nesting for as long as it lives; the parser and the interpreter recurse once per level, so
// this bound is what keeps the C++ stack from overflowing on a template nested thousands deep.
class NestingGuard {
public:
    NestingGuard(int& depth, const TemplateLimits& limits, int line) : depth_(depth) {
        if (++depth_ > limits.max_depth)
            fail_at(line, "nested deeper than ", limits.max_depth, " levels (TemplateLimits::max_depth)");
    }
    ~NestingGuard() { --depth_; }
    NestingGuard(const NestingGuard&) = delete;
    NestingGuard& operator=(const NestingGuard&) = delete;

private:
    int& depth_;
};

// =====================================================================================================================
// 1. LEXER — splits the template into text and tags, applies whitespace control, and cuts tag contents into tokens.
//    Jinja's whitespace rules all live here, because they are about source text, not about values:
//      `{%-` / `{{-` / `{#-` strip every whitespace character before the tag, `-%}` / `-}}` / `-#}` every one after;
//      trim_blocks drops the first newline after `%}` and `#}`; lstrip_blocks drops spaces and tabs between the start
//      of a line and `{%` / `{#`; `+` after `{%` or before `%}` turns those two off for that tag.
// =====================================================================================================================

enum class TokenKind { text, block_begin, block_end, var_begin, var_end, name, string, integer, floating, op, end };

struct Token {
    TokenKind kind;
    std::string text;  // the text, name, operator, or a string literal's decoded value
    int line;
};

inline bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v'; }

class Lexer {
public:
    explicit Lexer(std::string_view source) {
        // Jinja normalizes line endings to "\n" and, without keep_trailing_newline, drops one final newline.
        for (size_t i = 0; i < source.size(); ++i) {
            if (source[i] == '\r') {
                if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
                source_ += '\n';
            } else {
                source_ += source[i];
            }
        }
        if (!source_.empty() && source_.back() == '\n') source_.pop_back();
    }

    std::vector<Token> tokenize() {
        while (pos_ < source_.size()) {
            size_t open = find_tag_open(pos_);
            std::string text = source_.substr(pos_, open - pos_);
            if (open == source_.size()) {
                emit_text(std::move(text));
                break;
            }
            char kind = source_[open + 1];  // '{', '%' or '#'
            char sign = open + 2 < source_.size() ? source_[open + 2] : '\0';
            if (sign == '-') {
                while (!text.empty() && is_space(text.back())) text.pop_back();
            } else if (sign != '+' && kind != '{') {
                // lstrip_blocks: only spaces and tabs between the start of the line and the tag go.
                size_t run = open;
                while (run > pos_ && (source_[run - 1] == ' ' || source_[run - 1] == '\t')) --run;
                if (run == 0 || source_[run - 1] == '\n') text.resize(run - pos_);
            }
            emit_text(std::move(text));
            pos_ = open + 2 + (sign == '-' || sign == '+');
            if (kind == '#') lex_comment();
            else if (kind == '%' && is_raw_block()) lex_raw();
            else lex_tag(kind == '%');
        }
        push(TokenKind::end, "");
        return std::move(tokens_);
    }

private:
    size_t find_tag_open(size_t from) const {
        for (size_t i = from; i + 1 < source_.size(); ++i)
            if (source_[i] == '{' && (source_[i + 1] == '{' || source_[i + 1] == '%' || source_[i + 1] == '#')) return i;
        return source_.size();
    }

    // Tokens carry the line they start on, for error messages; lines are counted up to pos_ as tokens are made.
    void push(TokenKind kind, std::string text) {
        line_ += static_cast<int>(std::count(source_.begin() + long(counted_), source_.begin() + long(pos_), '\n'));
        counted_ = pos_;
        tokens_.push_back({kind, std::move(text), line_});
    }
    void emit_text(std::string text) {
        if (!text.empty()) push(TokenKind::text, std::move(text));
    }

    // After a tag's closing delimiter: `-` eats all following whitespace; trim_blocks eats one newline after `%}`.
    void after_tag_end(bool minus, bool plus, bool is_block) {
        if (minus)
            while (pos_ < source_.size() && is_space(source_[pos_])) ++pos_;
        else if (!plus && is_block && pos_ < source_.size() && source_[pos_] == '\n')
            ++pos_;
    }

    void lex_comment() {
        size_t close = source_.find("#}", pos_);
        if (close == std::string::npos) fail_at(line_, "unterminated comment '{#'");
        bool minus = close > pos_ && source_[close - 1] == '-';
        bool plus = close > pos_ && source_[close - 1] == '+';
        pos_ = close + 2;
        after_tag_end(minus, plus, true);
    }

    // `{% raw %}...{% endraw %}` copies its body verbatim, tags and all.
    bool is_raw_block() const {
        size_t i = pos_;
        while (i < source_.size() && is_space(source_[i])) ++i;
        return source_.compare(i, 3, "raw") == 0 && (i + 3 >= source_.size() || !std::isalnum(static_cast<unsigned char>(source_[i + 3])));
    }
    void lex_raw() {
        size_t close = source_.find("%}", pos_);
        if (close == std::string::npos) fail_at(line_, "unterminated '{% raw'");
        pos_ = close + 2;
        after_tag_end(source_[close - 1] == '-', source_[close - 1] == '+', true);
        for (size_t i = source_.find("{%", pos_); i != std::string::npos; i = source_.find("{%", i + 2)) {
            size_t word = i + 2 + (source_[i + 2] == '-' || source_[i + 2] == '+');
            while (word < source_.size() && is_space(source_[word])) ++word;
            if (source_.compare(word, 6, "endraw") != 0) continue;
            std::string body = source_.substr(pos_, i - pos_);
            if (source_[i + 2] == '-')
                while (!body.empty() && is_space(body.back())) body.pop_back();
            size_t end = source_.find("%}", word);
            if (end == std::string::npos) break;
            emit_text(std::move(body));
            pos_ = end + 2;
            after_tag_end(source_[end - 1] == '-', source_[end - 1] == '+', true);
            return;
        }
        fail_at(line_, "'{% raw %}' without '{% endraw %}'");
    }

    // The inside of `{{ ... }}` or `{% ... %}`: names, literals and operators up to the closing delimiter.
    void lex_tag(bool is_block) {
        push(is_block ? TokenKind::block_begin : TokenKind::var_begin, "");
        const char closer = is_block ? '%' : '}';
        int depth = 0;  // open brackets, so that `{{ {'a': {}} }}` closes at the right `}}`
        while (true) {
            while (pos_ < source_.size() && is_space(source_[pos_])) ++pos_;
            if (pos_ >= source_.size()) fail_at(line_, "unterminated tag, expected '", closer, "}'");
            std::string_view rest = std::string_view(source_).substr(pos_);
            bool minus = rest.size() >= 3 && (rest[0] == '-' || rest[0] == '+') && rest[1] == closer && rest[2] == '}';
            if (depth == 0 && (minus || (rest.size() >= 2 && rest[0] == closer && rest[1] == '}'))) {
                bool plus = minus && rest[0] == '+';
                minus = minus && rest[0] == '-';
                pos_ += (minus || plus) ? 3 : 2;
                push(is_block ? TokenKind::block_end : TokenKind::var_end, "");
                after_tag_end(minus, plus, is_block);
                return;
            }
            char c = rest[0];
            if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
                size_t n = 1;
                while (n < rest.size() && (std::isalnum(static_cast<unsigned char>(rest[n])) || rest[n] == '_')) ++n;
                push(TokenKind::name, std::string(rest.substr(0, n)));
                pos_ += n;
            } else if (std::isdigit(static_cast<unsigned char>(c))) {
                lex_number(rest);
            } else if (c == '\'' || c == '"') {
                lex_string(rest);
            } else {
                static constexpr std::string_view two_char_ops[] = {"//", "**", "==", "!=", "<=", ">="};
                std::string op(1, c);
                for (std::string_view two : two_char_ops)
                    if (rest.substr(0, 2) == two) op = two;
                if (op.size() == 1 && !std::strchr("+-*/%~<>=()[]{},.:|", c)) fail_at(line_, "unexpected character '", c, "'");
                if (op == "(" || op == "[" || op == "{") ++depth;
                if (op == ")" || op == "]" || op == "}") --depth;
                push(TokenKind::op, op);
                pos_ += op.size();
            }
        }
    }

    void lex_number(std::string_view rest) {
        size_t n = 0;
        bool is_float = false;
        auto digits = [&] {
            while (n < rest.size() && (std::isdigit(static_cast<unsigned char>(rest[n])) || rest[n] == '_')) ++n;
        };
        digits();
        if (n + 1 < rest.size() && rest[n] == '.' && std::isdigit(static_cast<unsigned char>(rest[n + 1]))) {
            is_float = true;
            ++n;
            digits();
        }
        if (n < rest.size() && (rest[n] == 'e' || rest[n] == 'E')) {
            size_t exp = n + 1 + (n + 1 < rest.size() && (rest[n + 1] == '+' || rest[n + 1] == '-'));
            if (exp < rest.size() && std::isdigit(static_cast<unsigned char>(rest[exp]))) {
                is_float = true;
                n = exp;
                digits();
            }
        }
        std::string text;
        for (char c : rest.substr(0, n))
            if (c != '_') text += c;
        push(is_float ? TokenKind::floating : TokenKind::integer, text);
        pos_ += n;
    }

    // String literals take Python's escapes (\n \t \\ \' \" \xNN \uNNNN), as Jinja decodes them with unicode_escape.
    void lex_string(std::string_view rest) {
        char quote = rest[0];
        std::string value;
        size_t i = 1;
        for (;; ++i) {
            if (i >= rest.size()) fail_at(line_, "unterminated string literal");
            char c = rest[i];
            if (c == quote) break;
            if (c != '\\' || i + 1 >= rest.size()) {
                value += c;
                continue;
            }
            char e = rest[++i];
            switch (e) {
                case 'n': value += '\n'; break;
                case 't': value += '\t'; break;
                case 'r': value += '\r'; break;
                case '0': value += '\0'; break;
                case '\\': case '\'': case '"': value += e; break;
                case 'x': case 'u': case 'U': {
                    size_t width = e == 'x' ? 2 : e == 'u' ? 4 : 8;
                    uint32_t code = 0;
                    std::string_view hex = rest.substr(i + 1, width);
                    if (hex.size() < width || std::from_chars(hex.data(), hex.data() + width, code, 16).ptr != hex.data() + width)
                        fail_at(line_, "bad \\", e, " escape in string literal");
                    infer::detail::append_utf8(value, code);
                    i += width;
                    break;
                }
                default: value += '\\'; value += e;  // Python keeps unknown escapes as written
            }
        }
        push(TokenKind::string, value);
        pos_ += i + 1;
    }

    std::string source_;
    size_t pos_ = 0;
    size_t counted_ = 0;  // newlines before this offset are counted in line_
    int line_ = 1;
    std::vector<Token> tokens_;
};

// =====================================================================================================================
// 2. VALUES — what expressions compute: Python's None, bool, int, float, str, list and dict, plus Jinja's Undefined
//    (a missing variable or key: renders as "", is falsy, iterates as empty, and fails when used further), namespace
//    objects, and callables (macros, globals). Lists, dicts and namespaces are shared by reference, as in Python, so
//    `set ns.x = ...` inside a loop is seen outside it. Strings are UTF-8; length and slicing count code points.
// =====================================================================================================================

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python dicts keep it
struct Args {
    std::vector<Value> positional;
    std::vector<std::pair<std::string, Value>> named;
};
using Function = std::function<Value(Args&)>;

struct Value {
    enum class Kind { undefined, none, boolean, integer, floating, string, list, dict, name_space, function };
    Kind kind = Kind::undefined;
    bool boolean = false;
    int64_t integer = 0;
    double floating = 0;
    std::string string;               // the text of a string; for Undefined, why it is undefined (Jinja's message)
    std::shared_ptr<List> list;
    std::shared_ptr<Dict> dict;       // dicts and namespaces
    std::shared_ptr<Function> function;

    static Value undefined(std::string why) { Value v; v.string = std::move(why); return v; }
    static Value none() { Value v; v.kind = Kind::none; return v; }
    static Value of(bool b) { Value v; v.kind = Kind::boolean; v.boolean = b; return v; }
    static Value of(int64_t i) { Value v; v.kind = Kind::integer; v.integer = i; return v; }
    static Value of(double f) { Value v; v.kind = Kind::floating; v.floating = f; return v; }
    static Value of(const char* s) { return of(std::string(s)); }  // not the bool overload
    static Value of(std::string s) { Value v; v.kind = Kind::string; v.string = std::move(s); return v; }
    static Value of(List l) { Value v; v.kind = Kind::list; v.list = std::make_shared<List>(std::move(l)); return v; }
    static Value of(Dict d, Kind kind = Kind::dict) { Value v; v.kind = kind; v.dict = std::make_shared<Dict>(std::move(d)); return v; }
    static Value of(Function f) { Value v; v.kind = Kind::function; v.function = std::make_shared<Function>(std::move(f)); return v; }

    bool is(Kind k) const { return kind == k; }
    bool is_number() const { return kind == Kind::integer || kind == Kind::floating || kind == Kind::boolean; }
    double as_double() const { return kind == Kind::floating ? floating : kind == Kind::integer ? double(integer) : double(boolean); }

    // A dict's or namespace's member, or nullptr.
    const Value* find(std::string_view key) const {
        if (!dict) return nullptr;
        for (const auto& [name, value] : *dict)
            if (name == key) return &value;
        return nullptr;
    }
    void set(const std::string& key, Value value) {
        for (auto& [name, old] : *dict)
            if (name == key) { old = std::move(value); return; }
        dict->emplace_back(key, std::move(value));
    }
};

inline Value from_json(const infer::Json& json) {
    if (json.is_null()) return Value::none();
    if (json.is_bool()) return Value::of(json.as_bool());
    if (json.is_string()) return Value::of(json.as_string());
    if (json.is_number()) {
        double x = json.as_number();
        bool whole = std::isfinite(x) && x == std::floor(x) && std::abs(x) < 9.2e18;
        return whole ? Value::of(static_cast<int64_t>(x)) : Value::of(x);
    }
    if (json.is_array()) {
        List list;
        for (const infer::Json& item : json.as_array()) list.push_back(from_json(item));
        return Value::of(std::move(list));
    }
    Dict dict;
    for (const auto& [key, item] : json.as_object()) dict.emplace_back(key, from_json(item));
    return Value::of(std::move(dict));
}

// Python's type names, for error messages that read like Jinja's.
inline const char* type_name(const Value& v) {
    static constexpr const char* names[] = {"Undefined", "NoneType", "bool", "int", "float", "str", "list", "dict", "Namespace", "function"};
    return names[static_cast<int>(v.kind)];
}

inline bool truthy(const Value& v) {
    switch (v.kind) {
        case Value::Kind::undefined: case Value::Kind::none: return false;
        case Value::Kind::boolean: return v.boolean;
        case Value::Kind::integer: return v.integer != 0;
        case Value::Kind::floating: return v.floating != 0;
        case Value::Kind::string: return !v.string.empty();
        case Value::Kind::list: return !v.list->empty();
        case Value::Kind::dict: return !v.dict->empty();
        default: return true;
    }
}

// UTF-8 text split into code points, each kept as its bytes: Python indexes strings by code point.
inline std::vector<std::string> code_points(std::string_view text) {
    std::vector<std::string> points;
    for (size_t i = 0; i < text.size();) {
        unsigned char lead = static_cast<unsigned char>(text[i]);
        size_t n = lead < 0x80 ? 1 : lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : lead >= 0xC0 ? 2 : 1;
        points.emplace_back(text.substr(i, n));
        i += n;
    }
    return points;
}

// Python's float repr: the shortest digits that read back exactly, in fixed notation for exponents -4..15.
inline std::string python_float(double x) {
    if (std::isnan(x)) return "nan";
    if (std::isinf(x)) return x < 0 ? "-inf" : "inf";
    char buffer[64];
    char* end = std::to_chars(buffer, buffer + sizeof buffer, x, std::chars_format::scientific).ptr;
    std::string sci(buffer, end);  // "-1.2345e+02"
    bool negative = sci[0] == '-';
    size_t e_pos = sci.find('e');
    std::string digits;
    for (char c : sci.substr(negative, e_pos - negative))
        if (c != '.') digits += c;
    int exponent = std::stoi(sci.substr(e_pos + 1));
    std::string out = negative ? "-" : "";
    if (exponent >= -4 && exponent < 16) {
        if (exponent < 0) {
            out += "0." + std::string(size_t(-exponent - 1), '0') + digits;
        } else {
            while (digits.size() < size_t(exponent) + 1) digits += '0';
            out += digits.substr(0, size_t(exponent) + 1) + "." + (digits.size() > size_t(exponent) + 1 ? digits.substr(size_t(exponent) + 1) : "0");
        }
        return out;
    }
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    std::string exp_digits = std::to_string(std::abs(exponent));
    return out + "e" + (exponent < 0 ? "-" : "+") + (exp_digits.size() < 2 ? "0" : "") + exp_digits;
}

// Python's repr of a str, used when a list or dict is printed: single quotes unless the text holds one.
inline std::string python_repr_string(const std::string& s) {
    char quote = s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
    std::string out(1, quote);
    for (char c : s) {
        if (c == quote || c == '\\') out += concat('\\', c);
        else if (c == '\n') out += "\\n";
        else if (c == '\r') out += "\\r";
        else if (c == '\t') out += "\\t";
        else if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
            char hex[8];
            std::snprintf(hex, sizeof hex, "\\x%02x", static_cast<unsigned char>(c));
            out += hex;
        } else out += c;
    }
    return out + quote;
}

// What `{{ value }}` prints: Python's str() of the value.
inline std::string to_text(const Value& v, bool repr = false) {
    switch (v.kind) {
        case Value::Kind::undefined: return "";
        case Value::Kind::none: return "None";
        case Value::Kind::boolean: return v.boolean ? "True" : "False";
        case Value::Kind::integer: return std::to_string(v.integer);
        case Value::Kind::floating: return python_float(v.floating);
        case Value::Kind::string: return repr ? python_repr_string(v.string) : v.string;
        case Value::Kind::list: {
            std::string out = "[";
            for (size_t i = 0; i < v.list->size(); ++i) out += (i ? ", " : "") + to_text((*v.list)[i], true);
            return out + "]";
        }
        case Value::Kind::dict: {
            std::string out = "{";
            for (size_t i = 0; i < v.dict->size(); ++i)
                out += (i ? ", " : "") + python_repr_string((*v.dict)[i].first) + ": " + to_text((*v.dict)[i].second, true);
            return out + "}";
        }
        case Value::Kind::name_space: return "<Namespace>";
        case Value::Kind::function: return "<function>";
    }
    return "";
}

// json.dumps(value, ensure_ascii, indent, separators, sort_keys), as transformers' tojson filter calls it. Python's
// layout with an indent: one member a line, "[]" and "{}" for empty containers, item separator without its space.
struct JsonStyle {
    bool ensure_ascii = false;
    int indent = -1;  // -1: everything on one line
    std::string item_separator = ", ", key_separator = ": ";
    bool sort_keys = false;
};

inline void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
    out += '"';
    for (const std::string& point : code_points(s)) {
        unsigned char c = static_cast<unsigned char>(point[0]);
        if (point == "\"") out += "\\\"";
        else if (point == "\\") out += "\\\\";
        else if (point == "\n") out += "\\n";
        else if (point == "\r") out += "\\r";
        else if (point == "\t") out += "\\t";
        else if (point == "\b") out += "\\b";
        else if (point == "\f") out += "\\f";
        else if (c < 0x20 || (ensure_ascii && c >= 0x80)) {
            uint32_t code = c;
            if (c >= 0x80) {  // decode the code point; beyond the BMP, Python writes a surrogate pair
                code = c & (c >= 0xF0 ? 0x07 : c >= 0xE0 ? 0x0F : 0x1F);
                for (size_t i = 1; i < point.size(); ++i) code = (code << 6) | (static_cast<unsigned char>(point[i]) & 0x3F);
            }
            char hex[16];
            if (code >= 0x10000)
                std::snprintf(hex, sizeof hex, "\\u%04x\\u%04x", 0xD800 + ((code - 0x10000) >> 10), 0xDC00 + ((code - 0x10000) & 0x3FF));
            else std::snprintf(hex, sizeof hex, "\\u%04x", code);
            out += hex;
        } else out += point;
    }
    out += '"';
}

inline void to_json(std::string& out, const Value& v, const JsonStyle& style, int depth) {
    auto newline = [&](int level) {
        if (style.indent < 0) return;
        out += '\n';
        out.append(static_cast<size_t>(style.indent * level), ' ');
    };
    switch (v.kind) {
        case Value::Kind::none: out += "null"; return;
        case Value::Kind::boolean: out += v.boolean ? "true" : "false"; return;
        case Value::Kind::integer: out += std::to_string(v.integer); return;
        case Value::Kind::floating:
            out += std::isnan(v.floating) ? "NaN" : std::isinf(v.floating) ? (v.floating < 0 ? "-Infinity" : "Infinity") : python_float(v.floating);
            return;
        case Value::Kind::string: json_string(out, v.string, style.ensure_ascii); return;
        case Value::Kind::list:
            if (v.list->empty()) { out += "[]"; return; }
            out += '[';
            for (size_t i = 0; i < v.list->size(); ++i) {
                if (i) out += style.item_separator;
                newline(depth + 1);
                to_json(out, (*v.list)[i], style, depth + 1);
            }
            newline(depth);
            out += ']';
            return;
        case Value::Kind::dict: {
            if (v.dict->empty()) { out += "{}"; return; }
            std::vector<const std::pair<std::string, Value>*> members;
            for (const auto& member : *v.dict) members.push_back(&member);
            if (style.sort_keys) std::stable_sort(members.begin(), members.end(), [](auto* a, auto* b) { return a->first < b->first; });
            out += '{';
            for (size_t i = 0; i < members.size(); ++i) {
                if (i) out += style.item_separator;
                newline(depth + 1);
                json_string(out, members[i]->first, style.ensure_ascii);
                out += style.key_separator;
                to_json(out, members[i]->second, style, depth + 1);
            }
            newline(depth);
            out += '}';
            return;
        }
        default: throw infer::Error(concat("tojson: Object of type ", type_name(v), " is not JSON serializable"));
    }
}

// Python's ==: numbers compare by value across bool/int/float, containers element by element.
inline bool equal(const Value& a, const Value& b) {
    if (a.is_number() && b.is_number()) {
        if (a.is(Value::Kind::floating) || b.is(Value::Kind::floating)) return a.as_double() == b.as_double();
        return (a.is(Value::Kind::integer) ? a.integer : a.boolean) == (b.is(Value::Kind::integer) ? b.integer : b.boolean);
    }
    if (a.kind != b.kind) return false;
    switch (a.kind) {
        case Value::Kind::string: return a.string == b.string;
        case Value::Kind::list:
            if (a.list->size() != b.list->size()) return false;
            for (size_t i = 0; i < a.list->size(); ++i)
                if (!equal((*a.list)[i], (*b.list)[i])) return false;
            return true;
        case Value::Kind::dict:
            if (a.dict->size() != b.dict->size()) return false;
            for (const auto& [key, value] : *a.dict)
                if (const Value* other = b.find(key); !other || !equal(value, *other)) return false;
            return true;
        case Value::Kind::name_space: return a.dict == b.dict;
        case Value::Kind::function: return a.function == b.function;
        default: return true;  // None == None, Undefined == Undefined
    }
}

// Python's <, for numbers, strings (UTF-8 byte order is code point order) and lists; anything else is a TypeError.
inline bool less(const Value& a, const Value& b, int line) {
    if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
    if (a.is(Value::Kind::string) && b.is(Value::Kind::string)) return a.string < b.string;
    if (a.is(Value::Kind::list) && b.is(Value::Kind::list)) {
        for (size_t i = 0; i < a.list->size() && i < b.list->size(); ++i) {
            if (less((*a.list)[i], (*b.list)[i], line)) return true;
            if (less((*b.list)[i], (*a.list)[i], line)) return false;
        }
        return a.list->size() < b.list->size();
    }
    fail_at(line, "'<' not supported between instances of '", type_name(a), "' and '", type_name(b), "'");
}

// =====================================================================================================================
// 3. PARSER — tokens to a tree. Expressions follow Jinja's precedence, loosest first:
//      x if c else y  <  or  <  and  <  not  <  comparisons, in, not in  <  + -  <  ~  <  * / // %  <  **
//      <  unary - +  <  filters `|f`, tests `is t`, and postfix `.a` `[i]` `[a:b:c]` `(args)`
//    so `messages|length - 1` is `(messages|length) - 1` and `'a' + x|trim` trims only x.
// =====================================================================================================================

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
    enum class Kind { literal, name, list, dict, attribute, item, slice, call, filter, test, unary, binary, conditional };
    Kind kind;
    int line;
    std::string name;                                      // variable, attribute, filter or test name; operator
    Value literal;                                         // for literals
    std::vector<ExprPtr> args;                             // operands; for calls/filters/tests args[0] is the subject
    std::vector<std::pair<std::string, ExprPtr>> kwargs;   // keyword arguments of calls, filters and tests
};

struct Stmt;
using Body = std::vector<std::unique_ptr<Stmt>>;

struct Stmt {
    enum class Kind { text, output, if_, for_, set, set_block, macro, break_, continue_ };
    Kind kind;
    int line;
    std::string text;                                      // text; macro name
    std::vector<std::string> targets;                      // for/set targets ("ns.attr" for namespace members); macro params
    std::vector<ExprPtr> exprs;                            // output/set value; for: iterable and filter; macro defaults
    std::vector<std::pair<ExprPtr, Body>> branches;        // if/elif conditions with their bodies
    Body body, else_body;
};

class Parser {
public:
    explicit Parser(std::vector<Token> tokens, TemplateLimits limits = {}) : tokens_(std::move(tokens)), limits_(limits) {}

    Body parse_template() {
        auto [body, stop] = parse_body({});
        return std::move(body);
    }

private:
    const Token& peek(size_t ahead = 0) const { return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)]; }
    const Token& next() { return tokens_[std::min(pos_++, tokens_.size() - 1)]; }
    bool at_op(std::string_view op) const { return peek().kind == TokenKind::op && peek().text == op; }
    bool at_name(std::string_view word) const { return peek().kind == TokenKind::name && peek().text == word; }
    bool accept_op(std::string_view op) { return at_op(op) ? (++pos_, true) : false; }
    bool accept_name(std::string_view word) { return at_name(word) ? (++pos_, true) : false; }
    void expect_op(std::string_view op) {
        if (!accept_op(op)) fail_at(peek().line, "expected '", op, "', found '", describe(peek()), "'");
    }
    void expect_block_end() {
        if (next().kind != TokenKind::block_end) fail_at(tokens_[pos_ - 1].line, "expected '%}', found '", describe(tokens_[pos_ - 1]), "'");
    }
    std::string expect_identifier() {
        if (peek().kind != TokenKind::name) fail_at(peek().line, "expected a name, found '", describe(peek()), "'");
        return next().text;
    }
    static std::string describe(const Token& t) {
        switch (t.kind) {
            case TokenKind::end: return "end of template";
            case TokenKind::block_end: return "%}";
            case TokenKind::var_end: return "}}";
            default: return t.text;
        }
    }
    ExprPtr make(Expr::Kind kind, int line, std::string name = {}) {
        auto e = std::make_unique<Expr>();
        e->kind = kind;
        e->line = line;
        e->name = std::move(name);
        return e;
    }

    // ---- statements ----
    // Parses text and tags until a `{% word %}` with a word in `stops`; returns the body and that word (consumed, the
    // rest of its tag is left for the caller). At the top level (`stops` empty) it runs to the end of the template.
    std::pair<Body, std::string> parse_body(const std::vector<std::string_view>& stops) {
        NestingGuard nesting(depth_, limits_, peek().line);
        Body body;
        while (true) {
            const Token& token = next();
            if (token.kind == TokenKind::end) {
                if (stops.empty()) return {std::move(body), ""};
                fail_at(token.line, "unexpected end of template, expected '{% ", stops.front(), " %}'");
            }
            if (token.kind == TokenKind::text) {
                auto s = std::make_unique<Stmt>(Stmt{Stmt::Kind::text, token.line, token.text, {}, {}, {}, {}, {}});
                body.push_back(std::move(s));
            } else if (token.kind == TokenKind::var_begin) {
                auto s = std::make_unique<Stmt>(Stmt{Stmt::Kind::output, token.line, {}, {}, {}, {}, {}, {}});
                s->exprs.push_back(parse_expression());
                if (next().kind != TokenKind::var_end) fail_at(token.line, "expected '}}' after the expression");
                body.push_back(std::move(s));
            } else if (token.kind == TokenKind::block_begin) {
                std::string word = expect_identifier();
                if (std::find(stops.begin(), stops.end(), word) != stops.end()) return {std::move(body), word};
                if (std::unique_ptr<Stmt> s = parse_statement(word, token.line)) body.push_back(std::move(s));
            } else {
                fail_at(token.line, "unexpected '", describe(token), "'");
            }
        }
    }

    std::unique_ptr<Stmt> parse_statement(const std::string& word, int line) {
        auto s = std::make_unique<Stmt>();
        s->line = line;
        if (word == "if") {
            s->kind = Stmt::Kind::if_;
            std::string stop = "elif";
            while (stop == "elif") {
                ExprPtr condition = parse_expression();
                expect_block_end();
                auto [body, word_] = parse_body({"elif", "else", "endif"});
                s->branches.emplace_back(std::move(condition), std::move(body));
                stop = word_;
            }
            if (stop == "else") {
                expect_block_end();
                s->else_body = parse_body({"endif"}).first;
            }
        } else if (word == "for") {
            s->kind = Stmt::Kind::for_;
            do s->targets.push_back(expect_identifier());
            while (accept_op(","));
            if (!accept_name("in")) fail_at(line, "expected 'in' in the for loop");
            s->exprs.push_back(parse_conditional(false));  // `for x in xs if c`: the `if` filters, it is no inline if
            if (accept_name("if")) s->exprs.push_back(parse_expression());
            if (accept_name("recursive")) fail_at(line, "unsupported: recursive for loops");
            expect_block_end();
            auto [body, stop] = parse_body({"else", "endfor"});
            s->body = std::move(body);
            if (stop == "else") {
                expect_block_end();
                s->else_body = parse_body({"endfor"}).first;
            }
        } else if (word == "set") {
            do {
                std::string target = expect_identifier();
                if (accept_op(".")) {
                    target += '.';
                    target += expect_identifier();
                }
                s->targets.push_back(target);
            } while (accept_op(","));
            if (accept_op("=")) {
                s->kind = Stmt::Kind::set;
                s->exprs.push_back(parse_tuple_or_expression());
            } else {  // {% set x %}...{% endset %} captures rendered text
                s->kind = Stmt::Kind::set_block;
                expect_block_end();
                s->body = parse_body({"endset"}).first;
            }
        } else if (word == "macro") {
            s->kind = Stmt::Kind::macro;
            s->text = expect_identifier();
            expect_op("(");
            while (!accept_op(")")) {
                s->targets.push_back(expect_identifier());
                s->exprs.push_back(accept_op("=") ? parse_expression() : nullptr);
                if (!at_op(")")) expect_op(",");
            }
            expect_block_end();
            s->body = parse_body({"endmacro"}).first;
        } else if (word == "break" || word == "continue") {
            s->kind = word == "break" ? Stmt::Kind::break_ : Stmt::Kind::continue_;
        } else if (word == "generation") {
            // transformers' AssistantTracker marks assistant text for training masks; for rendering it is a no-op.
            expect_block_end();
            auto inner = std::make_unique<Stmt>(Stmt{Stmt::Kind::if_, line, {}, {}, {}, {}, {}, {}});
            auto always = make(Expr::Kind::literal, line);
            always->literal = Value::of(true);
            inner->branches.emplace_back(std::move(always), parse_body({"endgeneration"}).first);
            s = std::move(inner);
        } else {
            fail_at(line, "unsupported statement '{% ", word, " %}'");
        }
        expect_block_end();
        return s;
    }

    // ---- expressions ----
    // `a, b` without brackets is a tuple (in `set x = a, b`), which we represent as a list.
    ExprPtr parse_tuple_or_expression() {
        ExprPtr first = parse_expression();
        if (!at_op(",")) return first;
        auto tuple = make(Expr::Kind::list, first->line);
        tuple->args.push_back(std::move(first));
        while (accept_op(",")) tuple->args.push_back(parse_expression());
        return tuple;
    }

    ExprPtr parse_expression() { return parse_conditional(true); }

    ExprPtr parse_conditional(bool allow_inline_if) {
        NestingGuard nesting(depth_, limits_, peek().line);
        ExprPtr value = parse_or();
        while (allow_inline_if && at_name("if")) {
            auto e = make(Expr::Kind::conditional, next().line);
            ExprPtr condition = parse_or();
            ExprPtr otherwise = accept_name("else") ? parse_conditional(true) : nullptr;
            e->args.push_back(std::move(value));
            e->args.push_back(std::move(condition));
            e->args.push_back(std::move(otherwise));  // may be null: `x if c` is undefined when c is false
            value = std::move(e);
        }
        return value;
    }

    ExprPtr binary(std::string op, ExprPtr left, ExprPtr right) {
        auto e = make(Expr::Kind::binary, left->line, std::move(op));
        e->args.push_back(std::move(left));
        e->args.push_back(std::move(right));
        return e;
    }

    ExprPtr parse_or() {
        ExprPtr left = parse_and();
        while (accept_name("or")) left = binary("or", std::move(left), parse_and());
        return left;
    }
    ExprPtr parse_and() {
        ExprPtr left = parse_not();
        while (accept_name("and")) left = binary("and", std::move(left), parse_not());
        return left;
    }
    ExprPtr parse_not() {
        NestingGuard nesting(depth_, limits_, peek().line);
        if (at_name("not")) {
            auto e = make(Expr::Kind::unary, next().line, "not");
            e->args.push_back(parse_not());
            return e;
        }
        return parse_compare();
    }
    ExprPtr parse_compare() {
        ExprPtr left = parse_math1();
        while (true) {
            static constexpr std::string_view ops[] = {"==", "!=", "<", ">", "<=", ">="};
            std::string op;
            for (std::string_view candidate : ops)
                if (at_op(candidate)) op = candidate;
            if (!op.empty()) ++pos_;
            else if (accept_name("in")) op = "in";
            else if (at_name("not") && peek(1).kind == TokenKind::name && peek(1).text == "in") {
                pos_ += 2;
                op = "not in";
            } else {
                return left;
            }
            left = binary(op, std::move(left), parse_math1());
        }
    }
    ExprPtr parse_math1() {
        ExprPtr left = parse_concat();
        while (at_op("+") || at_op("-")) {
            std::string op = next().text;
            left = binary(op, std::move(left), parse_concat());
        }
        return left;
    }
    ExprPtr parse_concat() {
        ExprPtr left = parse_math2();
        while (accept_op("~")) left = binary("~", std::move(left), parse_math2());
        return left;
    }
    ExprPtr parse_math2() {
        ExprPtr left = parse_pow();
        while (at_op("*") || at_op("/") || at_op("//") || at_op("%")) {
            std::string op = next().text;
            left = binary(op, std::move(left), parse_pow());
        }
        return left;
    }
    ExprPtr parse_pow() {
        ExprPtr left = parse_unary();
        while (accept_op("**")) left = binary("**", std::move(left), parse_unary());
        return left;
    }
    ExprPtr parse_unary() {
        NestingGuard nesting(depth_, limits_, peek().line);
        if (at_op("-") || at_op("+")) {
            auto e = make(Expr::Kind::unary, peek().line, next().text);
            e->args.push_back(parse_unary());
            return parse_filters(std::move(e));
        }
        return parse_filters(parse_postfix(parse_primary()));
    }

    // `x | f(args)`, `x is [not] t(args)`, and calls on their results.
    ExprPtr parse_filters(ExprPtr subject) {
        while (true) {
            if (accept_op("|")) {
                auto e = make(Expr::Kind::filter, subject->line, expect_identifier());
                e->args.push_back(std::move(subject));
                if (at_op("(")) parse_arguments(*e);
                subject = parse_postfix(std::move(e));
            } else if (accept_name("is")) {
                bool negated = accept_name("not");
                auto e = make(Expr::Kind::test, subject->line, expect_identifier());
                e->args.push_back(std::move(subject));
                if (at_op("(")) parse_arguments(*e);
                else if (peek().kind == TokenKind::string || peek().kind == TokenKind::integer || peek().kind == TokenKind::floating ||
                         (peek().kind == TokenKind::name && !at_name("and") && !at_name("or") && !at_name("else") &&
                          !at_name("if") && !at_name("in") && !at_name("not") && !at_name("is")))
                    e->args.push_back(parse_postfix(parse_primary()));  // `x is divisibleby 3`, `x is sameas none`
                subject = std::move(e);
                if (negated) {
                    auto n = make(Expr::Kind::unary, subject->line, "not");
                    n->args.push_back(std::move(subject));
                    subject = std::move(n);
                }
            } else {
                return subject;
            }
        }
    }

    ExprPtr parse_postfix(ExprPtr subject) {
        while (true) {
            if (accept_op(".")) {
                auto e = make(Expr::Kind::attribute, subject->line, expect_identifier());
                e->args.push_back(std::move(subject));
                subject = std::move(e);
            } else if (at_op("[")) {
                int line = next().line;
                ExprPtr parts[3];
                int colons = 0;
                while (!accept_op("]")) {
                    if (accept_op(":")) {
                        if (++colons > 2) fail_at(line, "too many ':' in a slice");
                    } else {
                        if (parts[colons]) fail_at(line, "expected ']' or ':' in a subscript");
                        parts[colons] = parse_expression();
                    }
                }
                auto e = make(colons ? Expr::Kind::slice : Expr::Kind::item, line);
                e->args.push_back(std::move(subject));
                if (!colons && !parts[0]) fail_at(line, "empty subscript '[]'");
                for (int i = 0; i <= (colons ? 2 : 0); ++i) e->args.push_back(std::move(parts[i]));
                subject = std::move(e);
            } else if (at_op("(")) {
                auto e = make(Expr::Kind::call, subject->line);
                e->args.push_back(std::move(subject));
                parse_arguments(*e);
                subject = std::move(e);
            } else {
                return subject;
            }
        }
    }

    void parse_arguments(Expr& call) {
        expect_op("(");
        while (!accept_op(")")) {
            if (peek().kind == TokenKind::name && peek(1).kind == TokenKind::op && peek(1).text == "=") {
                std::string key = next().text;
                ++pos_;
                call.kwargs.emplace_back(key, parse_expression());
            } else {
                call.args.push_back(parse_expression());
            }
            if (!at_op(")")) expect_op(",");
        }
    }

    ExprPtr parse_primary() {
        const Token& token = next();
        auto literal = [&](Value v) {
            auto e = make(Expr::Kind::literal, token.line);
            e->literal = std::move(v);
            return e;
        };
        switch (token.kind) {
            case TokenKind::string: {
                std::string text = token.text;
                while (peek().kind == TokenKind::string) text += next().text;  // 'a' 'b' is 'ab', as in Python
                return literal(Value::of(text));
            }
            case TokenKind::integer: {
                int64_t value = 0;  // Python's integers are unbounded; ours are 64-bit, and say so rather than wrap
                auto [end, error] = std::from_chars(token.text.data(), token.text.data() + token.text.size(), value);
                if (error != std::errc{} || end != token.text.data() + token.text.size())
                    fail_at(token.line, "integer literal ", token.text.substr(0, 40), " does not fit in 64 bits");
                return literal(Value::of(value));
            }
            case TokenKind::floating: {
                double value = std::strtod(token.text.c_str(), nullptr);  // 1e999 is inf, as in Python
                return literal(Value::of(value));
            }
            case TokenKind::name:
                if (token.text == "true" || token.text == "True") return literal(Value::of(true));
                if (token.text == "false" || token.text == "False") return literal(Value::of(false));
                if (token.text == "none" || token.text == "None") return literal(Value::none());
                return make(Expr::Kind::name, token.line, token.text);
            case TokenKind::op:
                if (token.text == "(") {
                    ExprPtr inner = parse_tuple_or_expression();
                    expect_op(")");
                    return inner;
                }
                if (token.text == "[") {
                    auto e = make(Expr::Kind::list, token.line);
                    while (!accept_op("]")) {
                        e->args.push_back(parse_expression());
                        if (!at_op("]")) expect_op(",");
                    }
                    return e;
                }
                if (token.text == "{") {
                    auto e = make(Expr::Kind::dict, token.line);  // args alternate key, value
                    while (!accept_op("}")) {
                        e->args.push_back(parse_expression());
                        expect_op(":");
                        e->args.push_back(parse_expression());
                        if (!at_op("}")) expect_op(",");
                    }
                    return e;
                }
                [[fallthrough]];
            default: fail_at(token.line, "unexpected '", describe(token), "' in an expression");
        }
    }

    std::vector<Token> tokens_;
    size_t pos_ = 0;
    TemplateLimits limits_;
    int depth_ = 0;  // open levels of nesting, for NestingGuard
};

// =====================================================================================================================
// 4. EVALUATION — walks the tree, appending to one output string. Scopes are a stack of frames: the template's top
//    level, one frame per loop iteration (so `set` inside a loop is forgotten after it, as in Jinja; namespaces are
//    how templates carry state out), and one per macro call.
//    Filters:  abs capitalize count d default dictsort e escape first float indent int items join last length list
//              lower map max min reject rejectattr replace reverse round safe select selectattr sort string sum
//              title tojson trim unique upper wordcount
//    Tests:    boolean callable defined divisibleby eq equalto even false float ge gt in integer iterable le lower
//              lt mapping ne none number odd sameas sequence string true undefined upper == != < <= > >=
//    Methods:  str: startswith endswith split rsplit strip lstrip rstrip upper lower title capitalize replace find
//              count join splitlines; dict: get items keys values
//    Globals:  namespace range dict raise_exception strftime_now, plus loop.cycle inside loops
// =====================================================================================================================

// Python's str.strip() without arguments strips Unicode whitespace, not only ASCII.
inline bool is_python_space(std::string_view point) {
    static const std::vector<std::string> unicode_spaces = [] {
        std::vector<std::string> spaces;
        for (uint32_t c : {0x85u, 0xA0u, 0x1680u, 0x2028u, 0x2029u, 0x202Fu, 0x205Fu, 0x3000u}) {
            spaces.emplace_back();
            infer::detail::append_utf8(spaces.back(), c);
        }
        for (uint32_t c = 0x2000; c <= 0x200A; ++c) {
            spaces.emplace_back();
            infer::detail::append_utf8(spaces.back(), c);
        }
        return spaces;
    }();
    if (point.size() == 1) return is_space(point[0]) || (point[0] >= 0x1c && point[0] <= 0x1f);
    return std::find(unicode_spaces.begin(), unicode_spaces.end(), point) != unicode_spaces.end();
}

// str.strip/lstrip/rstrip: `chars` is a set of code points; none means whitespace.
inline std::string strip(const std::string& text, const Value* chars, bool left, bool right) {
    std::vector<std::string> points = code_points(text);
    std::vector<std::string> set = chars && chars->is(Value::Kind::string) ? code_points(chars->string) : std::vector<std::string>{};
    auto strippable = [&](const std::string& p) {
        return chars && chars->is(Value::Kind::string) ? std::find(set.begin(), set.end(), p) != set.end() : is_python_space(p);
    };
    size_t begin = 0, end = points.size();
    while (left && begin < end && strippable(points[begin])) ++begin;
    while (right && end > begin && strippable(points[end - 1])) --end;
    std::string out;
    for (size_t i = begin; i < end; ++i) out += points[i];
    return out;
}

// str.split(sep=None, maxsplit=-1): without a separator, runs of whitespace split and ends are dropped.
inline List split(const std::string& text, const Value* separator, int64_t max_split) {
    List parts;
    if (!separator || separator->is(Value::Kind::none)) {
        std::vector<std::string> points = code_points(text);
        for (size_t i = 0;;) {
            while (i < points.size() && is_python_space(points[i])) ++i;
            if (i == points.size()) break;
            std::string word;
            bool last = max_split >= 0 && int64_t(parts.size()) == max_split;  // the rest, trailing spaces and all
            while (i < points.size() && (last || !is_python_space(points[i]))) word += points[i++];
            parts.push_back(Value::of(std::move(word)));
        }
        return parts;
    }
    const std::string& sep = separator->string;
    if (sep.empty()) throw infer::Error("split: empty separator");
    size_t start = 0;
    for (size_t at; (at = text.find(sep, start)) != std::string::npos && (max_split < 0 || int64_t(parts.size()) < max_split);
         start = at + sep.size())
        parts.push_back(Value::of(text.substr(start, at - start)));
    parts.push_back(Value::of(text.substr(start)));
    return parts;
}

inline std::string ascii_case(std::string text, int (*convert)(int)) {
    for (char& c : text) c = static_cast<char>(convert(static_cast<unsigned char>(c)));
    return text;
}

inline std::string replace_all(std::string text, const std::string& from, const std::string& to, int64_t count = -1) {
    if (from.empty()) return text;
    for (size_t at = text.find(from); at != std::string::npos && count != 0; at = text.find(from, at + to.size()), --count)
        text.replace(at, from.size(), to);
    return text;
}

// The items a `for` loop (or a filter such as join) visits: list items, dict keys, string code points.
inline List iterate(const Value& v, int line) {
    switch (v.kind) {
        case Value::Kind::undefined: return {};
        case Value::Kind::list: return *v.list;
        case Value::Kind::string: {
            List points;
            for (std::string& p : code_points(v.string)) points.push_back(Value::of(std::move(p)));
            return points;
        }
        case Value::Kind::dict: {
            List keys;
            for (const auto& member : *v.dict) keys.push_back(Value::of(member.first));
            return keys;
        }
        default: fail_at(line, "'", type_name(v), "' object is not iterable");
    }
}

// Python's clamp of slice bounds, for lists and code points alike.
inline std::vector<size_t> slice_indices(int64_t size, const Value& start, const Value& stop, const Value& step_value, int line) {
    auto bound = [&](const Value& v, const char* what) -> std::optional<int64_t> {
        if (v.is(Value::Kind::none) || v.is(Value::Kind::undefined)) return std::nullopt;
        if (!v.is(Value::Kind::integer)) fail_at(line, "slice ", what, " must be an integer, not ", type_name(v));
        return v.integer;
    };
    int64_t step = bound(step_value, "step").value_or(1);
    if (step == 0) fail_at(line, "slice step cannot be zero");
    auto clamp = [&](std::optional<int64_t> i, int64_t if_none) {
        if (!i) return if_none;
        int64_t x = *i < 0 ? *i + size : *i;
        return step > 0 ? std::clamp<int64_t>(x, 0, size) : std::clamp<int64_t>(x, -1, size - 1);
    };
    int64_t begin = clamp(bound(start, "start"), step > 0 ? 0 : size - 1);
    int64_t end = clamp(bound(stop, "stop"), step > 0 ? size : -1);
    std::vector<size_t> indices;
    for (int64_t i = begin; step > 0 ? i < end : i > end; i += step) indices.push_back(size_t(i));
    return indices;
}

enum class Flow { normal, break_, continue_ };

class Interpreter {
public:
    explicit Interpreter(std::map<std::string, Value> globals, TemplateLimits limits = {}) : limits_(limits) {
        frames_.push_back(std::move(globals));
    }

    std::string run(const Body& body) {
        execute(body);
        return std::move(out_);
    }

private:
    using Frame = std::map<std::string, Value>;

    // ---- scopes ----
    Value lookup(const std::string& name) const {
        for (auto frame = frames_.rbegin(); frame != frames_.rend(); ++frame)
            if (auto found = frame->find(name); found != frame->end()) return found->second;
        return Value::undefined(concat("'", name, "' is undefined"));
    }

    void assign(const std::vector<std::string>& targets, const Value& value, int line) {
        if (targets.size() == 1) return assign_one(targets[0], value, line);
        List items = iterate(value, line);
        if (items.size() != targets.size())
            fail_at(line, "cannot unpack ", items.size(), " values into ", targets.size(), " names");
        for (size_t i = 0; i < targets.size(); ++i) assign_one(targets[i], items[i], line);
    }
    void assign_one(const std::string& target, const Value& value, int line) {
        size_t dot = target.find('.');
        if (dot == std::string::npos) {
            frames_.back()[target] = value;
            return;
        }
        Value object = lookup(target.substr(0, dot));
        if (!object.is(Value::Kind::name_space))
            fail_at(line, "cannot assign attribute on non-namespace object '", target.substr(0, dot), "'");
        object.set(target.substr(dot + 1), value);
    }

    // ---- statements ----
    // Every statement, loop iteration and expression costs a step: a budget bounds the work of loops over loops.
    void count_step(int line) {
        if (++steps_ > limits_.max_steps)
            fail_at(line, "rendering took more than ", limits_.max_steps, " steps (TemplateLimits::max_steps)");
    }
    void check_size(size_t bytes, int line) const {
        if (bytes > limits_.max_output)
            fail_at(line, "output or string larger than ", limits_.max_output, " bytes (TemplateLimits::max_output)");
    }
    void check_items(size_t items, int line) const {
        if (items > limits_.max_items)
            fail_at(line, "a list of more than ", limits_.max_items, " items (TemplateLimits::max_items)");
    }

    Flow execute(const Body& body) {
        NestingGuard nesting(depth_, limits_, body.empty() ? 0 : body.front()->line);
        for (const auto& stmt : body)
            if (Flow flow = execute(*stmt); flow != Flow::normal) return flow;
        return Flow::normal;
    }

    Flow execute(const Stmt& s) {
        count_step(s.line);
        switch (s.kind) {
            case Stmt::Kind::text:
                out_ += s.text;
                check_size(out_.size(), s.line);
                break;
            case Stmt::Kind::output:
                out_ += to_text(evaluate(*s.exprs[0]));
                check_size(out_.size(), s.line);
                break;
            case Stmt::Kind::if_:
                for (const auto& [condition, body] : s.branches)
                    if (truthy(evaluate(*condition))) return execute(body);
                return execute(s.else_body);
            case Stmt::Kind::for_: return execute_for(s);
            case Stmt::Kind::set: assign(s.targets, evaluate(*s.exprs[0]), s.line); break;
            case Stmt::Kind::set_block: {
                std::string saved = std::move(out_);
                out_.clear();
                execute(s.body);
                assign(s.targets, Value::of(std::exchange(out_, std::move(saved))), s.line);
                break;
            }
            case Stmt::Kind::macro: frames_.back()[s.text] = make_macro(s); break;
            case Stmt::Kind::break_: return Flow::break_;
            case Stmt::Kind::continue_: return Flow::continue_;
        }
        return Flow::normal;
    }

    Flow execute_for(const Stmt& s) {
        List items;
        for (Value& item : iterate(evaluate(*s.exprs[0]), s.line)) {
            if (s.exprs.size() > 1) {  // `for x in xs if cond`: the filter sees x, and filtered items don't count in loop.*
                frames_.emplace_back();
                assign(s.targets, item, s.line);
                bool keep = truthy(evaluate(*s.exprs[1]));
                frames_.pop_back();
                if (!keep) continue;
            }
            items.push_back(std::move(item));
        }
        if (items.empty()) return execute(s.else_body);
        const auto length = static_cast<int64_t>(items.size());
        for (int64_t i = 0; i < length; ++i) {
            Dict loop = {{"index0", Value::of(i)},
                         {"index", Value::of(i + 1)},
                         {"revindex0", Value::of(length - i - 1)},
                         {"revindex", Value::of(length - i)},
                         {"first", Value::of(i == 0)},
                         {"last", Value::of(i == length - 1)},
                         {"length", Value::of(length)},
                         {"previtem", i > 0 ? items[size_t(i - 1)] : Value::undefined("there is no previous item")},
                         {"nextitem", i + 1 < length ? items[size_t(i + 1)] : Value::undefined("there is no next item")},
                         {"cycle", Value::of(Function([i](Args& args) {
                              if (args.positional.empty()) throw infer::Error("loop.cycle: no items to cycle");
                              return args.positional[size_t(i) % args.positional.size()];
                          }))}};
            count_step(s.line);
            frames_.emplace_back();  // a fresh scope per iteration: `set` inside the body does not outlive it
            frames_.back()["loop"] = Value::of(std::move(loop));
            assign(s.targets, items[size_t(i)], s.line);
            Flow flow = execute(s.body);
            frames_.pop_back();
            if (flow == Flow::break_) break;
        }
        return Flow::normal;
    }

    // A macro call renders its body in a new frame above the template's top level, and returns the text.
    Value make_macro(const Stmt& s) {
        return Value::of(Function([this, &s](Args& args) {
            if (args.positional.size() > s.targets.size())
                fail_at(s.line, "macro '", s.text, "' takes ", s.targets.size(), " arguments, got ", args.positional.size());
            Frame frame;
            for (size_t i = 0; i < s.targets.size(); ++i) {
                if (i < args.positional.size()) frame[s.targets[i]] = args.positional[i];
                else if (s.exprs[i]) frame[s.targets[i]] = evaluate(*s.exprs[i]);
                else frame[s.targets[i]] = Value::undefined(concat("parameter '", s.targets[i], "' was not provided"));
            }
            for (auto& [key, value] : args.named) {
                if (std::find(s.targets.begin(), s.targets.end(), key) == s.targets.end())
                    fail_at(s.line, "macro '", s.text, "' has no parameter '", key, "'");
                frame[key] = value;
            }
            NestingGuard nesting(depth_, limits_, s.line);  // a macro calling itself recurses here
            std::vector<Frame> saved = std::exchange(frames_, {frames_.front(), std::move(frame)});
            std::string saved_out = std::exchange(out_, {});
            execute(s.body);
            frames_ = std::move(saved);
            return Value::of(std::exchange(out_, std::move(saved_out)));
        }));
    }

    // ---- expressions ----
    Value evaluate(const Expr& e) {
        count_step(e.line);
        Value value = compute(e);
        if (value.is(Value::Kind::string)) check_size(value.string.size(), e.line);
        if (value.is(Value::Kind::list)) check_items(value.list->size(), e.line);
        return value;
    }
    Value compute(const Expr& e) {
        switch (e.kind) {
            case Expr::Kind::literal: return e.literal;
            case Expr::Kind::name: return lookup(e.name);
            case Expr::Kind::list: {
                List items;
                for (const auto& item : e.args) items.push_back(evaluate(*item));
                return Value::of(std::move(items));
            }
            case Expr::Kind::dict: {
                Value dict = Value::of(Dict{});
                for (size_t i = 0; i + 1 < e.args.size(); i += 2) {
                    Value key = evaluate(*e.args[i]);
                    if (!key.is(Value::Kind::string)) fail_at(e.line, "dict keys must be strings, not ", type_name(key));
                    dict.set(key.string, evaluate(*e.args[i + 1]));
                }
                return dict;
            }
            case Expr::Kind::attribute: return get_attribute(evaluate(*e.args[0]), e.name, e.line);
            case Expr::Kind::item: return get_item(evaluate(*e.args[0]), evaluate(*e.args[1]), e.line);
            case Expr::Kind::slice: {
                Value subject = evaluate(*e.args[0]);
                Value bounds[3];
                for (int i = 0; i < 3; ++i) bounds[i] = e.args[1 + i] ? evaluate(*e.args[1 + i]) : Value::none();
                return slice(subject, bounds[0], bounds[1], bounds[2], e.line);
            }
            case Expr::Kind::call: return call(e);
            case Expr::Kind::filter: {
                Args args = evaluate_arguments(e);
                return apply_filter(e.name, args, e.line);
            }
            case Expr::Kind::test: {
                Args args = evaluate_arguments(e);
                return Value::of(apply_test(e.name, args, e.line));
            }
            case Expr::Kind::unary: {
                Value operand = evaluate(*e.args[0]);
                if (e.name == "not") return Value::of(!truthy(operand));
                if (operand.is(Value::Kind::integer)) return Value::of(e.name == "-" ? -operand.integer : operand.integer);
                if (operand.is_number()) return Value::of(e.name == "-" ? -operand.as_double() : operand.as_double());
                fail_at(e.line, "bad operand type for unary ", e.name, ": '", type_name(operand), "'");
            }
            case Expr::Kind::binary: return binary(e);
            case Expr::Kind::conditional:
                if (truthy(evaluate(*e.args[1]))) return evaluate(*e.args[0]);
                return e.args[2] ? evaluate(*e.args[2]) : Value::undefined("the inline if's condition was false");
        }
        return Value();
    }

    Args evaluate_arguments(const Expr& e) {
        Args args;
        for (const auto& arg : e.args) args.positional.push_back(evaluate(*arg));  // [0] is the subject
        for (const auto& [key, arg] : e.kwargs) args.named.emplace_back(key, evaluate(*arg));
        return args;
    }

    // Using an Undefined for anything but printing, testing or iterating is an error, as with Jinja's Undefined.
    static void require_defined(const Value& v, int line) {
        if (v.is(Value::Kind::undefined)) fail_at(line, v.string);
    }

    // `x.name`: a dict's or namespace's member; Jinja's message for a missing one, kept for when it is used.
    static Value get_attribute(const Value& object, const std::string& name, int line) {
        require_defined(object, line);
        if (object.dict) {
            if (const Value* member = object.find(name)) return *member;
            return Value::undefined(concat("'", object.is(Value::Kind::dict) ? "dict" : "Namespace", " object' has no attribute '", name, "'"));
        }
        return Value::undefined(concat("'", type_name(object), " object' has no attribute '", name, "'"));
    }

    // `x[key]`: dict by key, list and string by (possibly negative) index; a miss is Undefined, as in Jinja.
    static Value get_item(const Value& object, const Value& key, int line) {
        require_defined(object, line);
        if (object.dict && key.is(Value::Kind::string)) return get_attribute(object, key.string, line);
        if (key.is(Value::Kind::integer) && (object.is(Value::Kind::list) || object.is(Value::Kind::string))) {
            std::vector<std::string> points;
            if (object.is(Value::Kind::string)) points = code_points(object.string);
            int64_t size = object.is(Value::Kind::list) ? int64_t(object.list->size()) : int64_t(points.size());
            int64_t i = key.integer < 0 ? key.integer + size : key.integer;
            if (i >= 0 && i < size) return object.is(Value::Kind::list) ? (*object.list)[size_t(i)] : Value::of(points[size_t(i)]);
        }
        return Value::undefined(concat(type_name(object), " object has no element ", to_text(key, true)));  // Jinja's words
    }

    static Value slice(const Value& subject, const Value& start, const Value& stop, const Value& step, int line) {
        require_defined(subject, line);
        if (subject.is(Value::Kind::list)) {
            List out;
            for (size_t i : slice_indices(int64_t(subject.list->size()), start, stop, step, line)) out.push_back((*subject.list)[i]);
            return Value::of(std::move(out));
        }
        if (subject.is(Value::Kind::string)) {
            std::vector<std::string> points = code_points(subject.string);
            std::string out;
            for (size_t i : slice_indices(int64_t(points.size()), start, stop, step, line)) out += points[i];
            return Value::of(out);
        }
        fail_at(line, "'", type_name(subject), "' object is not subscriptable");
    }

    // x**y for y >= 0 by repeated squaring; false when the result does not fit in 64 bits.
    static bool integer_power(int64_t x, int64_t y, int64_t& result) {
        result = 1;
        while (y > 0) {
            if ((y & 1) && __builtin_mul_overflow(result, x, &result)) return false;
            y >>= 1;
            if (y > 0 && __builtin_mul_overflow(x, x, &x)) return false;
        }
        return true;
    }

    Value binary(const Expr& e) {
        const std::string& op = e.name;
        Value left = evaluate(*e.args[0]);
        if (op == "and") return truthy(left) ? evaluate(*e.args[1]) : left;  // Python returns an operand, not a bool
        if (op == "or") return truthy(left) ? left : evaluate(*e.args[1]);
        Value right = evaluate(*e.args[1]);
        if (op == "~") return Value::of(to_text(left) + to_text(right));
        if (op == "==") return Value::of(equal(left, right));
        if (op == "!=") return Value::of(!equal(left, right));
        if (op == "<") return Value::of(less(left, right, e.line));
        if (op == ">") return Value::of(less(right, left, e.line));
        if (op == "<=") return Value::of(!less(right, left, e.line));
        if (op == ">=") return Value::of(!less(left, right, e.line));
        if (op == "in" || op == "not in") return Value::of(contains(right, left, e.line) == (op == "in"));
        require_defined(left, e.line);
        require_defined(right, e.line);
        if (op == "+" && left.is(Value::Kind::string) && right.is(Value::Kind::string)) return Value::of(left.string + right.string);
        if (op == "+" && left.is(Value::Kind::list) && right.is(Value::Kind::list)) {
            check_items(left.list->size() + right.list->size(), e.line);
            List joined = *left.list;
            joined.insert(joined.end(), right.list->begin(), right.list->end());
            return Value::of(std::move(joined));
        }
        if (op == "*" && left.is(Value::Kind::string) && right.is(Value::Kind::integer)) {
            if (right.integer > 0 && !left.string.empty())  // check before building it, not after
                check_size(right.integer > int64_t(limits_.max_output) ? limits_.max_output + 1 : left.string.size() * size_t(right.integer), e.line);
            std::string repeated;
            for (int64_t i = 0; i < right.integer; ++i) repeated += left.string;
            return Value::of(repeated);
        }
        if (!left.is_number() || !right.is_number())
            fail_at(e.line, "unsupported operand type(s) for ", op, ": '", type_name(left), "' and '", type_name(right), "'");
        bool integers = !left.is(Value::Kind::floating) && !right.is(Value::Kind::floating);
        double a = left.as_double(), b = right.as_double();
        if ((op == "/" || op == "//" || op == "%") && b == 0) fail_at(e.line, "division by zero");
        // Booleans count as 0 and 1; integers stay exact (no trip through double) and overflow is an error.
        auto exact = [](const Value& v) { return v.is(Value::Kind::integer) ? v.integer : int64_t(v.as_double()); };
        if (integers && (op == "+" || op == "-" || op == "*" || op == "//" || op == "%" || (op == "**" && exact(right) >= 0))) {
            int64_t x = exact(left), y = exact(right), result = 0;
            bool overflow = false;
            if (op == "+") overflow = __builtin_add_overflow(x, y, &result);
            else if (op == "-") overflow = __builtin_sub_overflow(x, y, &result);
            else if (op == "*") overflow = __builtin_mul_overflow(x, y, &result);
            else if (op == "**") overflow = !integer_power(x, y, result);
            else if (x == INT64_MIN && y == -1) overflow = true;
            else {
                int64_t quotient = x / y, remainder = x % y;
                if (remainder != 0 && ((remainder < 0) != (y < 0))) --quotient, remainder += y;  // Python floors
                result = op == "//" ? quotient : remainder;
            }
            if (overflow) fail_at(e.line, "integer overflow in ", x, " ", op, " ", y, " (integers are 64-bit here)");
            return Value::of(result);
        }
        if (op == "+") return Value::of(a + b);
        if (op == "-") return Value::of(a - b);
        if (op == "*") return Value::of(a * b);
        if (op == "/") return Value::of(a / b);
        if (op == "//") return Value::of(std::floor(a / b));
        if (op == "%") return Value::of(a - b * std::floor(a / b));
        if (op == "**") return Value::of(std::pow(a, b));
        fail_at(e.line, "unknown operator '", op, "'");
    }

    static bool contains(const Value& container, const Value& item, int line) {
        switch (container.kind) {
            case Value::Kind::string:
                if (!item.is(Value::Kind::string)) fail_at(line, "'in <string>' requires string as left operand, not ", type_name(item));
                return container.string.find(item.string) != std::string::npos;
            case Value::Kind::list:
                return std::any_of(container.list->begin(), container.list->end(), [&](const Value& v) { return equal(v, item); });
            case Value::Kind::dict: return item.is(Value::Kind::string) && container.find(item.string);
            case Value::Kind::undefined: return false;
            default: fail_at(line, "argument of type '", type_name(container), "' is not iterable");
        }
    }

    // ---- calls: globals, macros, and methods of strings and dicts ----
    Value call(const Expr& e) {
        const Expr& callee = *e.args[0];
        Args args;
        for (size_t i = 1; i < e.args.size(); ++i) args.positional.push_back(evaluate(*e.args[i]));
        for (const auto& [key, arg] : e.kwargs) args.named.emplace_back(key, evaluate(*arg));
        if (callee.kind == Expr::Kind::attribute) {
            Value object = evaluate(*callee.args[0]);
            require_defined(object, e.line);
            if (object.is(Value::Kind::string)) return string_method(object.string, callee.name, args, e.line);
            // Python finds a dict's methods before its keys: `message.items()` is the method even with an "items" key.
            static constexpr std::string_view dict_methods[] = {"get", "items", "keys", "values"};
            if (object.is(Value::Kind::dict) && std::find(std::begin(dict_methods), std::end(dict_methods), callee.name) != std::end(dict_methods))
                return dict_method(object, callee.name, args, e.line);
            Value member = get_attribute(object, callee.name, e.line);
            if (member.is(Value::Kind::function)) return (*member.function)(args);
            require_defined(member, e.line);
            fail_at(e.line, "'", type_name(object), "' object has no method '", callee.name, "'");
        }
        Value function = evaluate(callee);
        require_defined(function, e.line);
        if (!function.is(Value::Kind::function)) fail_at(e.line, "'", type_name(function), "' object is not callable");
        return (*function.function)(args);
    }

    // The i-th positional argument or the keyword `name`, else nullptr.
    static const Value* argument(const Args& args, size_t i, std::string_view name) {
        if (i < args.positional.size()) return &args.positional[i];
        for (const auto& [key, value] : args.named)
            if (key == name) return &value;
        return nullptr;
    }
    static const Value* keyword_argument(const Args& args, std::string_view name) {
        return argument(args, args.positional.size(), name);
    }
    static std::string string_argument(const Args& args, size_t i, std::string_view name, std::string_view where, int line) {
        const Value* v = argument(args, i, name);
        if (!v || !v->is(Value::Kind::string)) fail_at(line, where, ": argument '", name, "' must be a string");
        return v->string;
    }
    static int64_t int_argument(const Args& args, size_t i, std::string_view name, int64_t fallback) {
        const Value* v = argument(args, i, name);
        return v && v->is(Value::Kind::integer) ? v->integer : fallback;
    }

    static Value string_method(const std::string& s, const std::string& name, const Args& args, int line) {
        if (name == "startswith" || name == "endswith") {
            const Value* affix = argument(args, 0, "prefix");
            List candidates = affix && affix->is(Value::Kind::list) ? *affix->list : List{affix ? *affix : Value()};
            for (const Value& c : candidates) {
                if (!c.is(Value::Kind::string)) fail_at(line, "str.", name, ": argument must be str or a tuple of str");
                bool hit = name == "startswith" ? s.compare(0, c.string.size(), c.string) == 0 : infer::detail::ends_with(s, c.string);
                if (hit) return Value::of(true);
            }
            return Value::of(false);
        }
        if (name == "strip" || name == "lstrip" || name == "rstrip")
            return Value::of(strip(s, argument(args, 0, "chars"), name != "rstrip", name != "lstrip"));
        if (name == "split") return Value::of(split(s, argument(args, 0, "sep"), int_argument(args, 1, "maxsplit", -1)));
        if (name == "rsplit" && !argument(args, 1, "maxsplit")) return Value::of(split(s, argument(args, 0, "sep"), -1));
        if (name == "splitlines") {
            Value newline = Value::of("\n");
            List lines = split(s, &newline, -1);
            if (!lines.empty() && lines.back().string.empty()) lines.pop_back();
            return Value::of(std::move(lines));
        }
        if (name == "upper") return Value::of(ascii_case(s, ::toupper));
        if (name == "lower") return Value::of(ascii_case(s, ::tolower));
        if (name == "title" || name == "capitalize") return string_filter(name, s);
        if (name == "replace")
            return Value::of(replace_all(s, string_argument(args, 0, "old", "str.replace", line),
                                         string_argument(args, 1, "new", "str.replace", line), int_argument(args, 2, "count", -1)));
        if (name == "find") {
            size_t at = s.find(string_argument(args, 0, "sub", "str.find", line));
            return Value::of(at == std::string::npos ? int64_t(-1) : int64_t(code_points(s.substr(0, at)).size()));
        }
        if (name == "count") {
            std::string sub = string_argument(args, 0, "sub", "str.count", line);
            int64_t n = 0;
            for (size_t at = s.find(sub); at != std::string::npos; at = s.find(sub, at + std::max<size_t>(sub.size(), 1))) ++n;
            return Value::of(n);
        }
        if (name == "join") {
            std::string out;
            const Value* items = argument(args, 0, "iterable");
            if (!items) fail_at(line, "str.join: missing argument");
            List list = iterate(*items, line);
            for (size_t i = 0; i < list.size(); ++i) out += (i ? s : "") + to_text(list[i]);
            return Value::of(out);
        }
        fail_at(line, "unsupported string method 'str.", name, "'");
    }

    static Value dict_method(const Value& d, const std::string& name, const Args& args, int line) {
        if (name == "get") {
            const Value* key = argument(args, 0, "key");
            const Value* member = key && key->is(Value::Kind::string) ? d.find(key->string) : nullptr;
            if (member) return *member;
            const Value* fallback = argument(args, 1, "default");
            return fallback ? *fallback : Value::none();
        }
        if (name == "items") return filter_items(d);
        List out;
        for (const auto& [key, value] : *d.dict) {
            if (name == "keys") out.push_back(Value::of(key));
            else if (name == "values") out.push_back(value);
            else fail_at(line, "unsupported dict method 'dict.", name, "'");
        }
        return Value::of(std::move(out));
    }

    static Value filter_items(const Value& d) {
        List out;
        for (const auto& [key, value] : *d.dict) out.push_back(Value::of(List{Value::of(key), value}));
        return Value::of(std::move(out));
    }

    static Value string_filter(const std::string& name, std::string s) {
        bool word_start = true;
        for (size_t i = 0; i < s.size(); ++i) {
            unsigned char c = static_cast<unsigned char>(s[i]);
            if (name == "capitalize") s[i] = static_cast<char>(i == 0 ? std::toupper(c) : std::tolower(c));
            else s[i] = static_cast<char>(word_start ? std::toupper(c) : std::tolower(c));
            word_start = !std::isalnum(c);
        }
        return Value::of(s);
    }

    // ---- filters: `x | name(args)`; args.positional[0] is x ----
    Value apply_filter(const std::string& name, Args& args, int line) {
        Value& x = args.positional[0];
        auto arg = [&](size_t i, std::string_view key) { return argument(args, i + 1, key); };
        auto need_string = [&] { return to_text(x); };  // Jinja's string filters stringify first; Undefined is ""
        if (name == "safe" || name == "e" || name == "escape") return x;  // no autoescape in transformers' environment
        if (name == "default" || name == "d") {
            const Value* boolean = arg(1, "boolean");
            bool use_default = x.is(Value::Kind::undefined) || (boolean && truthy(*boolean) && !truthy(x));
            const Value* fallback = arg(0, "default_value");
            return use_default ? (fallback ? *fallback : Value::of(std::string())) : x;
        }
        if (name == "trim") return Value::of(strip(need_string(), arg(0, "chars"), true, true));
        if (name == "upper") return Value::of(ascii_case(need_string(), ::toupper));
        if (name == "lower") return Value::of(ascii_case(need_string(), ::tolower));
        if (name == "title" || name == "capitalize") return string_filter(name, need_string());
        if (name == "string") return Value::of(to_text(x));
        if (name == "replace")
            return Value::of(replace_all(need_string(), string_argument(args, 1, "old", "replace", line),
                                         string_argument(args, 2, "new", "replace", line), int_argument(args, 3, "count", -1)));
        if (name == "indent") {
            int64_t width = int_argument(args, 1, "width", 4);
            if (width > 4096) throw infer::Error(concat("indent: width ", width, " is larger than 4096"));
            const Value* first = arg(1, "first");
            const Value* blank = arg(2, "blank");
            std::string pad(size_t(std::max<int64_t>(width, 0)), ' '), out;
            Value newline = Value::of("\n");
            List lines = split(need_string(), &newline, -1);
            for (size_t i = 0; i < lines.size(); ++i) {
                const std::string& text = lines[i].string;
                bool indent = (i > 0 || (first && truthy(*first))) && (!text.empty() || (blank && truthy(*blank)));
                out += (i ? "\n" : "") + (indent ? pad : "") + text;
            }
            return Value::of(out);
        }
        if (name == "wordcount") return Value::of(int64_t(split(need_string(), nullptr, -1).size()));
        if (name == "tojson") {
            JsonStyle style;
            if (const Value* ascii = arg(0, "ensure_ascii")) style.ensure_ascii = truthy(*ascii);
            if (const Value* indent = arg(1, "indent"); indent && indent->is(Value::Kind::integer)) {
                if (indent->integer > 4096) throw infer::Error(concat("tojson: indent ", indent->integer, " is larger than 4096"));
                style.indent = int(indent->integer);
                style.item_separator = ",";
            }
            if (const Value* separators = arg(2, "separators"); separators && separators->is(Value::Kind::list) && separators->list->size() == 2) {
                style.item_separator = to_text((*separators->list)[0]);
                style.key_separator = to_text((*separators->list)[1]);
            }
            if (const Value* sort = arg(3, "sort_keys")) style.sort_keys = truthy(*sort);
            std::string out;
            try {
                to_json(out, x, style, 0);
            } catch (const infer::Error& error) {
                fail_at(line, error.what());
            }
            return Value::of(out);
        }
        if (name == "length" || name == "count") {
            if (x.is(Value::Kind::string)) return Value::of(int64_t(code_points(x.string).size()));
            if (x.is(Value::Kind::dict) || x.is(Value::Kind::list) || x.is(Value::Kind::undefined))
                return Value::of(int64_t(iterate(x, line).size()));
            fail_at(line, "object of type '", type_name(x), "' has no len()");
        }
        if (name == "int") {
            if (x.is(Value::Kind::string)) {
                int64_t parsed = 0;
                std::string text = strip(x.string, nullptr, true, true);
                auto result = std::from_chars(text.data(), text.data() + text.size(), parsed);
                if (result.ec == std::errc() && result.ptr == text.data() + text.size()) return Value::of(parsed);
                const Value* fallback = arg(0, "default");
                return fallback ? *fallback : Value::of(int64_t(0));
            }
            return Value::of(x.is_number() ? int64_t(x.as_double()) : int64_t(0));
        }
        if (name == "float") {
            if (x.is(Value::Kind::string)) {
                char* end = nullptr;
                double parsed = std::strtod(x.string.c_str(), &end);
                return Value::of(end != x.string.c_str() && *end == '\0' ? parsed : 0.0);
            }
            return Value::of(x.is_number() ? x.as_double() : 0.0);
        }
        if (name == "abs") {
            if (x.is(Value::Kind::integer)) return Value::of(x.integer < 0 ? -x.integer : x.integer);
            if (x.is_number()) return Value::of(std::abs(x.as_double()));
            fail_at(line, "bad operand type for abs(): '", type_name(x), "'");
        }
        if (name == "round") {
            int64_t digits = int_argument(args, 1, "precision", 0);
            double scale = std::pow(10.0, double(digits));
            return Value::of(std::nearbyint(x.as_double() * scale) / scale);  // round-half-even, as Python's round
        }
        if (name == "items") {
            if (x.is(Value::Kind::undefined)) return Value::of(List{});
            if (!x.is(Value::Kind::dict)) fail_at(line, "items: expected a dict, got ", type_name(x));
            return filter_items(x);
        }
        if (name == "dictsort") {
            if (!x.is(Value::Kind::dict)) fail_at(line, "dictsort: expected a dict, got ", type_name(x));
            Value items = filter_items(x);
            std::stable_sort(items.list->begin(), items.list->end(),
                             [](const Value& a, const Value& b) { return (*a.list)[0].string < (*b.list)[0].string; });
            return items;
        }
        // The rest take an iterable.
        List items = iterate(x, line);
        if (name == "list") return Value::of(std::move(items));
        if (name == "first") return items.empty() ? Value::undefined("first: the sequence is empty") : items.front();
        if (name == "last") return items.empty() ? Value::undefined("last: the sequence is empty") : items.back();
        if (name == "reverse") {
            if (x.is(Value::Kind::string)) return slice(x, Value::none(), Value::none(), Value::of(int64_t(-1)), line);
            std::reverse(items.begin(), items.end());
            return Value::of(std::move(items));
        }
        const Value* attribute = keyword_argument(args, "attribute");
        auto attribute_of = [&](const Value& item) { return attribute ? get_item(item, *attribute, line) : item; };
        if (name == "join") {
            const Value* separator = arg(0, "d");
            std::string out;
            for (size_t i = 0; i < items.size(); ++i) out += (i && separator ? to_text(*separator) : "") + to_text(attribute_of(items[i]));
            return Value::of(out);
        }
        if (name == "sum") {
            Value total = Value::of(int64_t(0));
            for (const Value& item : items) {
                Value v = attribute_of(item);
                total = total.is(Value::Kind::integer) && v.is(Value::Kind::integer) ? Value::of(total.integer + v.integer)
                                                                                      : Value::of(total.as_double() + v.as_double());
            }
            return total;
        }
        if (name == "sort" || name == "min" || name == "max" || name == "unique") {
            const Value* reverse = arg(0, "reverse");
            std::stable_sort(items.begin(), items.end(), [&](const Value& a, const Value& b) { return less(attribute_of(a), attribute_of(b), line); });
            if (name == "min") return items.empty() ? Value::undefined("min: the sequence is empty") : items.front();
            if (name == "max") return items.empty() ? Value::undefined("max: the sequence is empty") : items.back();
            if (reverse && truthy(*reverse)) std::reverse(items.begin(), items.end());
            if (name == "unique") {
                List kept;  // keeps first occurrences in the original order
                for (const Value& item : iterate(x, line))
                    if (std::none_of(kept.begin(), kept.end(), [&](const Value& k) { return equal(attribute_of(k), attribute_of(item)); }))
                        kept.push_back(item);
                return Value::of(std::move(kept));
            }
            return Value::of(std::move(items));
        }
        if (name == "map") {  // map(attribute='x') or map('filter', args...)
            List out;
            for (const Value& item : items) {
                if (attribute) {
                    out.push_back(attribute_of(item));
                    continue;
                }
                Args inner;
                inner.positional.push_back(item);
                inner.positional.insert(inner.positional.end(), args.positional.begin() + std::min<long>(2, long(args.positional.size())),
                                        args.positional.end());
                out.push_back(apply_filter(string_argument(args, 1, "filter", "map", line), inner, line));
            }
            return Value::of(std::move(out));
        }
        if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
            bool by_attribute = name.size() > 6;  // selectattr(attr, test, args...) vs select(test, args...)
            size_t test_at = by_attribute ? 2 : 1;
            List out;
            for (const Value& item : items) {
                Args inner;
                inner.positional.push_back(by_attribute ? get_item(item, args.positional.at(1), line) : item);
                inner.positional.insert(inner.positional.end(), args.positional.begin() + std::min(test_at + 1, args.positional.size()),
                                        args.positional.end());
                bool passed = test_at < args.positional.size()
                                  ? apply_test(string_argument(args, test_at, "test", name, line), inner, line)
                                  : truthy(inner.positional[0]);
                if (passed == (name[0] == 's')) out.push_back(item);
            }
            return Value::of(std::move(out));
        }
        fail_at(line, "unknown filter '", name, "'");
    }

    // ---- tests: `x is name(args)`; args.positional[0] is x ----
    bool apply_test(const std::string& name, Args& args, int line) {
        const Value& x = args.positional[0];
        using K = Value::Kind;
        if (name == "defined") return !x.is(K::undefined);
        if (name == "undefined") return x.is(K::undefined);
        if (name == "none") return x.is(K::none);
        if (name == "boolean") return x.is(K::boolean);
        if (name == "true") return x.is(K::boolean) && x.boolean;
        if (name == "false") return x.is(K::boolean) && !x.boolean;
        if (name == "string") return x.is(K::string);
        if (name == "number") return x.is_number();
        if (name == "integer") return x.is(K::integer);
        if (name == "float") return x.is(K::floating);
        if (name == "mapping") return x.is(K::dict);
        if (name == "iterable") return x.is(K::list) || x.is(K::dict) || x.is(K::string);
        if (name == "sequence") return x.is(K::list) || x.is(K::dict) || x.is(K::string);
        if (name == "callable") return x.is(K::function);
        if (name == "lower") return x.is(K::string) && ascii_case(x.string, ::tolower) == x.string;
        if (name == "upper") return x.is(K::string) && ascii_case(x.string, ::toupper) == x.string;
        static constexpr std::string_view comparisons[] = {"divisibleby", "eq", "equalto", "==", "ne", "!=", "lt", "lessthan", "<",
                                                           "gt", "greaterthan", ">", "le", "<=", "ge", ">=", "in", "sameas"};
        if (name != "odd" && name != "even" && std::find(std::begin(comparisons), std::end(comparisons), name) == std::end(comparisons))
            fail_at(line, "unknown test '", name, "'");
        const Value* other = argument(args, 1, "value");
        if (name == "odd" || name == "even" || name == "divisibleby") {
            if (!x.is(K::integer)) fail_at(line, "test '", name, "' needs an integer, got ", type_name(x));
            int64_t divisor = name == "divisibleby" ? (other && other->is(K::integer) ? other->integer : 0) : 2;
            if (divisor == 0) fail_at(line, "test 'divisibleby' needs a nonzero integer argument");
            bool divisible = x.integer % divisor == 0;
            return name == "odd" ? !divisible : divisible;
        }
        if (!other) fail_at(line, "test '", name, "' needs an argument");
        if (name == "eq" || name == "equalto" || name == "==") return equal(x, *other);
        if (name == "ne" || name == "!=") return !equal(x, *other);
        if (name == "lt" || name == "lessthan" || name == "<") return less(x, *other, line);
        if (name == "gt" || name == "greaterthan" || name == ">") return less(*other, x, line);
        if (name == "le" || name == "<=") return !less(*other, x, line);
        if (name == "ge" || name == ">=") return !less(x, *other, line);
        if (name == "in") return contains(*other, x, line);
        return x.kind == other->kind && (x.dict ? x.dict == other->dict : equal(x, *other));  // sameas
    }

    std::vector<Frame> frames_;
    std::string out_;
    TemplateLimits limits_;
    int depth_ = 0;      // open levels of nesting, for NestingGuard
    int64_t steps_ = 0;  // work done so far, against limits_.max_steps
};

// The globals transformers defines, plus Jinja's own namespace/range/dict.
inline std::map<std::string, Value> builtin_globals() {
    std::map<std::string, Value> globals;
    globals["raise_exception"] = Value::of(Function([](Args& args) -> Value {
        // The template's message, unchanged: callers show it to the user as the reason the conversation is rejected.
        throw infer::Error(args.positional.empty() ? std::string() : to_text(args.positional[0]));
    }));
    globals["strftime_now"] = Value::of(Function([](Args& args) {
        std::time_t now = std::time(nullptr);
        std::tm local{};
        localtime_r(&now, &local);
        char buffer[256];
        std::string format = args.positional.empty() ? "" : to_text(args.positional[0]);
        size_t n = std::strftime(buffer, sizeof buffer, format.c_str(), &local);
        return Value::of(std::string(buffer, n));
    }));
    globals["namespace"] = Value::of(Function([](Args& args) {
        Value ns = Value::of(Dict{}, Value::Kind::name_space);
        for (const Value& initial : args.positional)
            if (initial.is(Value::Kind::dict))
                for (const auto& [key, value] : *initial.dict) ns.set(key, value);
        for (auto& [key, value] : args.named) ns.set(key, value);
        return ns;
    }));
    globals["dict"] = Value::of(Function([](Args& args) {
        Value dict = Value::of(Dict{});
        for (auto& [key, value] : args.named) dict.set(key, value);
        return dict;
    }));
    globals["range"] = Value::of(Function([](Args& args) {
        int64_t bounds[3] = {0, 0, 1};
        for (size_t i = 0; i < args.positional.size() && i < 3; ++i) {
            if (!args.positional[i].is(Value::Kind::integer)) throw infer::Error("range: arguments must be integers");
            bounds[i] = args.positional[i].integer;
        }
        if (args.positional.size() == 1) std::swap(bounds[0], bounds[1]);
        if (bounds[2] == 0) throw infer::Error("range: step must not be zero");
        if ((static_cast<__int128>(bounds[1]) - bounds[0]) / bounds[2] > 1000000) throw infer::Error("range: more than a million items");
        List out;
        for (int64_t i = bounds[0]; bounds[2] > 0 ? i < bounds[1] : i > bounds[1];) {
            out.push_back(Value::of(i));
            if (__builtin_add_overflow(i, bounds[2], &i)) break;  // the next item would lie past INT64_MAX: none left
        }
        return Value::of(std::move(out));
    }));
    return globals;
}

}  // namespace detail

// =====================================================================================================================
// 5. API — render a template with the variables transformers passes, and the built-in templates for models whose
//    tokenizer_config.json has none.
// =====================================================================================================================

// Renders `template_source` as `tokenizer.apply_chat_template(messages, add_generation_prompt=..., tokenize=False,
// **extra_context)` would. `extra_context` is a JSON object (bos_token, eos_token, tools, enable_thinking, ...) or null.
// tools and documents default to None, as transformers always passes them. Throws infer::Error on template errors;
// for raise_exception(message), the error's message is exactly the template's message.
inline std::string render(std::string_view template_source, const infer::Json& messages, bool add_generation_prompt,
                          const infer::Json& extra_context, const TemplateLimits& limits = {}) {
    std::map<std::string, detail::Value> globals = detail::builtin_globals();
    globals["tools"] = detail::Value::none();
    globals["documents"] = detail::Value::none();
    if (extra_context.is_object())
        for (const auto& [key, value] : extra_context.as_object()) globals[key] = detail::from_json(value);
    else if (!extra_context.is_null())
        throw infer::Error("chat::render: extra_context must be a JSON object or null");
    globals["messages"] = detail::from_json(messages);
    globals["add_generation_prompt"] = detail::Value::of(add_generation_prompt);
    detail::Parser parser(detail::Lexer(template_source).tokenize(), limits);
    detail::Body body = parser.parse_template();
    return detail::Interpreter(std::move(globals), limits).run(body);
}

// The standard public templates of three prompt formats, for models that ship none.
inline const char* builtin_template(std::string_view name) {
    // ChatML (OpenAI; used by Qwen, Yi, many fine-tunes): every turn is <|im_start|>role\n...<|im_end|>\n. With tools,
    // the Hermes convention Qwen follows: a system turn lists the functions as JSON inside <tools></tools> and asks for
    // calls as <tool_call>{"name", "arguments"}</tool_call>; an assistant's calls are written back that way, and a
    // tool's result comes back in a user turn inside <tool_response></tool_response>.
    static constexpr const char* chatml =
        "{% if tools %}{{ '<|im_start|>system\\n' }}{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] + "
        "'\\n\\n' }}{% endif %}{{ 'You can call these functions. Their signatures, one JSON object a line:\\n<tools>' }}"
        "{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}{{ '\\n</tools>\\n\\nTo call one, reply with ' + "
        "'<tool_call>\\n{\"name\": <function name>, \"arguments\": <arguments as a JSON object>}\\n</tool_call>' + "
        "'<|im_end|>\\n' }}{% endif %}"
        "{% for message in messages %}{% if tools and loop.first and message['role'] == 'system' %}"
        "{% elif message['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + message['content'] + "
        "'\\n</tool_response><|im_end|>\\n' }}"
        "{% else %}{{'<|im_start|>' + message['role'] + '\\n' + message['content']}}{% if message['tool_calls'] %}"
        "{% for call in message['tool_calls'] %}{{ '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + "
        "'\", \"arguments\": ' + (call['function']['arguments'] if call['function']['arguments'] is string else "
        "call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}{% endfor %}{% endif %}"
        "{{ '<|im_end|>' + '\\n'}}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
    // Llama 3 Instruct, as in Meta-Llama-3-8B-Instruct's tokenizer_config.json: header tokens around the role,
    // content trimmed, <|eot_id|> after each turn, bos_token before the first.
    static constexpr const char* llama3 =
        "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
        "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
        "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
    // Llama 2 Chat, as in Llama-2-7b-chat-hf: [INST] ... [/INST] pairs, the system prompt folded into the first user
    // turn inside <<SYS>> markers, and strict user/assistant alternation.
    static constexpr const char* llama2 =
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}{% set system_message = "
        "messages[0]['content'] %}{% else %}{% set loop_messages = messages %}{% set system_message = false %}{% endif %}"
        "{% for message in loop_messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}{% set content = '<<SYS>>\\n' + system_message + "
        "'\\n<</SYS>>\\n\\n' + message['content'] %}{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}{% endfor %}";
    if (name == "chatml") return chatml;
    if (name == "llama3") return llama3;
    if (name == "llama2") return llama2;
    return nullptr;
}

}  // namespace chat
