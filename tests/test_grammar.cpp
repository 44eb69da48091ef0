// Structured outputs (section 04, appendix J): regular expressions to byte automata, JSON Schemas to expressions, the
// token masks that the trie walk computes (checked token by token against stepping the automaton through each
// token's bytes, on the real tokenizers), and the sampler and engine honouring a grammar and logit_bias.
#include "support.hpp"


namespace {

// The demo model's tokenizer has a byte token for every byte: any text can be fed to a grammar one byte at a time.
struct ByteFeeder {
    ByteFeeder() : tokenizer(infer::tokenizer_for(model())), trie(std::make_shared<infer::TokenTrie>(tokenizer)) {
        byte_id.fill(-1);
        for (int id = 0; id < trie->vocab_size(); ++id)
            if (const std::string* bytes = trie->bytes(id); bytes && bytes->size() == 1 && byte_id[static_cast<uint8_t>((*bytes)[0])] < 0)
                byte_id[static_cast<uint8_t>((*bytes)[0])] = id;
    }
    static const infer::Model& model() {
        static infer::Model m = infer::demo_model();
        return m;
    }
    // Whether `regex` matches all of `text`.
    bool matches(const std::string& regex, std::string_view text) const {
        infer::Grammar grammar(regex, trie, "test");
        int state = infer::Grammar::start;
        for (char c : text) {
            state = grammar.advance(state, byte_id[static_cast<uint8_t>(c)]);
            if (state < 0) return false;
        }
        return grammar.accepts(state);
    }
    infer::Tokenizer tokenizer;
    std::shared_ptr<infer::TokenTrie> trie;
    std::array<int, 256> byte_id{};
};

const ByteFeeder& feeder() {
    static ByteFeeder f;
    return f;
}

const char* person_schema = R"({
  "type": "object",
  "properties": {
    "name": {"type": "string", "minLength": 1, "maxLength": 8},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "score": {"type": "number"},
    "member": {"type": "boolean"},
    "pet": {"enum": ["cat", "dog", null]},
    "kind": {"const": "person"},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "minItems": 1, "maxItems": 3},
    "home": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "zip": {"type": "integer"}},
             "required": ["city"]},
    "nick": {"anyOf": [{"type": "string", "maxLength": 5}, {"type": "null"}]}
  },
  "required": ["name", "age", "kind", "tags"]
})";

}  // namespace

TEST_CASE("regular expressions: the dialect, UTF-8 classes, and what is refused by name") {
    const ByteFeeder& f = feeder();
    CHECK(f.matches("(yes|no)", "yes"));
    CHECK(f.matches("(yes|no)", "no"));
    CHECK_FALSE(f.matches("(yes|no)", "ye"));
    CHECK_FALSE(f.matches("(yes|no)", "yesno"));
    CHECK(f.matches("[a-c]{2,3}x?", "abx"));
    CHECK(f.matches("[a-c]{2,3}x?", "cab"));
    CHECK_FALSE(f.matches("[a-c]{2,3}x?", "a"));
    CHECK_FALSE(f.matches("[a-c]{2,3}x?", "abcab"));
    CHECK(f.matches("\\d+(\\.\\d+)?", "3.14"));
    CHECK_FALSE(f.matches("\\d+(\\.\\d+)?", "3."));
    CHECK(f.matches("^[^\"]*$", "no quotes here"));
    CHECK_FALSE(f.matches("[^\"]*", "a\"b"));
    CHECK(f.matches("\\w+\\s\\W", "ab_9 !"));
    CHECK(f.matches("a{3}", "aaa"));
    CHECK_FALSE(f.matches("a{3}", "aaaa"));
    CHECK(f.matches("a{2,}", "aaaaa"));
    CHECK(f.matches("(?:ab)*c", "ababc"));
    CHECK(f.matches("(?<word>ab)+", "abab"));
    CHECK(f.matches("x*?y", "xxy"));  // lazy: the same language when the whole output must match
    // Classes of code points become UTF-8 byte sequences: whole characters, of every length.
    CHECK(f.matches("[α-ω]+", "λόγος") == false);  // ό is U+03CC, outside α–ω
    CHECK(f.matches("[α-ω]+", "λογος"));
    CHECK(f.matches(".", "ж"));
    CHECK(f.matches(".", "😀"));
    CHECK_FALSE(f.matches(".", "\n"));
    CHECK(f.matches("[^a]", "€"));
    CHECK_FALSE(f.matches("[^a]", "a"));
    CHECK(f.matches("é+", "ééé"));
    CHECK(f.matches("\\u00e9", "é"));
    CHECK(f.matches("a|[]", "a"));  // [] matches nothing; the other branch remains
    CHECK(test::error_of([] { feeder().matches("[]", ""); }).find("matches nothing") != std::string::npos);
    CHECK(test::error_of([] { feeder().matches("(a)\\1", "aa"); }).find("\\1, which is not supported") != std::string::npos);
    CHECK(test::error_of([] { feeder().matches("(?=a)a", "a"); }).find("lookaround") != std::string::npos);
    CHECK(test::error_of([] { feeder().matches("\\bword", "word"); }).find("not supported") != std::string::npos);
    CHECK(test::error_of([] { feeder().matches("(ab", "ab"); }).find("unmatched '('") != std::string::npos);
    CHECK(test::error_of([] { feeder().matches("a{5,2}", "a"); }).find("m < n") != std::string::npos);
    CHECK(test::error_of([] { feeder().matches("a{2000}", "a"); }).find("count above 1000") != std::string::npos);
    // Hostile sizes end in a message, not a blown stack or an automaton that fills the memory.
    CHECK(test::error_of([] { feeder().matches(std::string(300, '(') + "a" + std::string(300, ')'), "a"); })
              .find("nests groups more than 256 deep") != std::string::npos);
    CHECK(test::error_of([] { feeder().matches("((a{1000}){1000}){1000}", "a"); }).find("automaton states") != std::string::npos);
}

TEST_CASE("integer ranges: every integer in [-1200, 1200] is matched exactly when it is inside the bounds") {
    const ByteFeeder& f = feeder();
    using Bound = std::optional<int64_t>;
    const std::vector<std::pair<Bound, Bound>> ranges = {
        {0, 120}, {7, 7}, {13, 987}, {-45, 12}, {std::nullopt, -3}, {250, std::nullopt}, {-1000, -10}, {100, 199}, {1, 1000}};
    for (const auto& range : ranges) {
        const Bound lo = range.first, hi = range.second;  // named apart: clang refuses bindings in doctest's lambdas
        infer::Grammar grammar(infer::detail::integer_range(lo, hi), f.trie, "range");
        for (int64_t x = -1200; x <= 1200; ++x) {
            int state = infer::Grammar::start;
            for (char c : std::to_string(x)) state = state < 0 ? -1 : grammar.advance(state, f.byte_id[static_cast<uint8_t>(c)]);
            const bool inside = (!lo || x >= *lo) && (!hi || x <= *hi);
            if ((state >= 0 && grammar.accepts(state)) != inside)
                FAIL_CHECK("range [" << (lo ? std::to_string(*lo) : "-inf") << ", " << (hi ? std::to_string(*hi) : "inf") << "] gets " << x << " wrong");
        }
        CHECK_FALSE(f.matches(infer::detail::integer_range(lo, hi), "007"));  // no leading zeros
    }
}

TEST_CASE("JSON Schemas and json_object: what they accept, and keywords refused with their place") {
    const ByteFeeder& f = feeder();
    const std::string person = infer::regex_for_json_schema(infer::Json::parse(person_schema));
    CHECK(f.matches(person, R"({"name":"Ann","age":31,"kind":"person","tags":["a"]})"));
    CHECK(f.matches(person, R"({"name": "Bo", "age": 0, "score": -1.5e3, "member": true, "pet": null, "kind": "person", "tags": ["x", "yz"], "home": {"city": "Oslo"}, "nick": null})"));
    CHECK_FALSE(f.matches(person, R"({"name":"Ann","kind":"person","tags":["a"]})"));             // age is required
    CHECK_FALSE(f.matches(person, R"({"name":"Ann","age":121,"kind":"person","tags":["a"]})"));   // above maximum
    CHECK_FALSE(f.matches(person, R"({"name":"Ann","age":3,"kind":"person","tags":[]})"));        // minItems
    CHECK_FALSE(f.matches(person, R"({"name":"Ann","age":3,"kind":"person","tags":["a"],"x":1})"));  // no other properties
    CHECK_FALSE(f.matches(person, R"({"name":"","age":3,"kind":"person","tags":["a"]})"));        // minLength
    CHECK_FALSE(f.matches(person, R"({"name":"Ann","age":3,"kind":"robot","tags":["a"]})"));      // const
    CHECK(f.matches(person, R"({"name":"\u00e9\n","age":3,"kind":"person","tags":["a"]})"));       // escapes
    CHECK_FALSE(f.matches(person, "{\"name\":\"a\nb\",\"age\":3,\"kind\":\"person\",\"tags\":[\"a\"]}"));  // raw control character

    const std::string object = infer::regex_for_json_object();
    CHECK(f.matches(object, R"({"a": [1, {"b": null}], "c": "d", "e": -0.5, "f": true})"));
    CHECK(f.matches(object, "{}"));
    CHECK_FALSE(f.matches(object, "[1]"));
    CHECK_FALSE(f.matches(object, R"({"a":})"));
    CHECK_FALSE(f.matches(object, R"({"a":1,})"));

    // $defs, recursion unrolled to a bounded depth.
    const std::string tree = infer::regex_for_json_schema(infer::Json::parse(R"({
        "$defs": {"node": {"type": "object", "properties": {"v": {"type": "integer"},
                           "next": {"anyOf": [{"$ref": "#/$defs/node"}, {"type": "null"}]}}, "required": ["v", "next"]}},
        "$ref": "#/$defs/node"})"));
    CHECK(f.matches(tree, R"({"v":1,"next":{"v":2,"next":null}})"));

    auto refused = [](const char* schema) {
        return test::error_of([&] { infer::regex_for_json_schema(infer::Json::parse(schema), "response_format.json_schema.schema"); });
    };
    CHECK(refused(R"({"type":"object","properties":{"id":{"type":"string","pattern":"^a+$"}}})") ==
          "response_format.json_schema.schema at /properties/id: keyword \"pattern\" is not supported by structured outputs");
    CHECK(refused(R"({"type":"number","minimum":0})").find("supported for integers only") != std::string::npos);
    CHECK(refused(R"({"type":"string","format":"email"})").find("format \"email\" is not supported") != std::string::npos);
    CHECK(refused(R"({"type":"object","properties":{"a":{}},"required":["b"]})").find("names \"b\"") != std::string::npos);
    CHECK(refused(R"({"$ref":"#/$defs/missing"})").find("is not a definition") != std::string::npos);
    CHECK(refused(R"({"type":"widget"})").find("unknown type \"widget\"") != std::string::npos);
    // $refs that each use the next twice would write 2^40 copies: refused while the expression is still small.
    std::string chain = R"({"$defs": {)";
    for (int i = 0; i < 40; ++i)
        chain += (i ? "," : "") + infer::concat("\"d", i, "\": {\"type\": \"array\", \"items\": {\"anyOf\": [{\"$ref\": \"#/$defs/d", i + 1,
                                               "\"}, {\"$ref\": \"#/$defs/d", i + 1, "\"}]}}");
    chain += R"(, "d40": {"type": "null"}}, "$ref": "#/$defs/d0"})";
    CHECK(refused(chain.c_str()).find("simplify it") != std::string::npos);
}

TEST_CASE("token masks: the trie walk allows exactly the tokens whose bytes keep the automaton alive (real tokenizers)") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string regex = infer::regex_for_json_schema(infer::Json::parse(person_schema));
    for (const char* name : {"llama2", "mistral", "llama3", "qwen3", "gpt2"}) {
        CAPTURE(name);
        const std::filesystem::path file = test::shared_dir() / "tokenizers" / name / "tokenizer.json";
        if (!std::filesystem::exists(file)) continue;
        infer::Tokenizer tokenizer = infer::load_tokenizer(file);
        // Token bytes are what the tokens add inside a text: an encoded text's tokens spell it again (a leading space
        // that SentencePiece adds to the first word aside).
        const std::string text = "Ünïcode, {\"json\": [1, 2.5e-3, null]}\n\ttabs 日本語 😀";
        const std::vector<std::optional<std::string>> bytes = tokenizer.all_token_bytes();
        std::string spelled;
        for (int id : tokenizer.encode(text, false)) {
            REQUIRE(bytes[static_cast<size_t>(id)].has_value());
            spelled += *bytes[static_cast<size_t>(id)];
        }
        CHECK((spelled == text || spelled == " " + text));

        auto trie = std::make_shared<infer::TokenTrie>(tokenizer);
        infer::Grammar grammar(regex, trie, "person");
        // Walk one output, checking the mask at every state on the way against stepping each token alone. The
        // output is cut into tokens greedily: at each step the longest token that spells the text that comes next.
        const std::string output = R"({"name": "Ann", "age": 31, "kind": "person", "tags": ["a", "bc"], "nick": null})";
        int state = infer::Grammar::start;
        int checked_states = 0;
        size_t at = 0;
        while (state >= 0) {
            const std::vector<uint64_t>& mask = grammar.mask(state);
            int mismatches = 0;
            for (int id = 0; id < tokenizer.vocab_size(); ++id) {
                const bool allowed = !mask.empty() && (mask[static_cast<size_t>(id) / 64] >> (id % 64) & 1);
                const bool end = std::find(trie->end_ids().begin(), trie->end_ids().end(), id) != trie->end_ids().end();
                const bool expected = end ? grammar.accepts(state) : grammar.advance(state, id) >= 0;
                mismatches += allowed != expected;
            }
            CHECK(mismatches == 0);
            ++checked_states;
            if (at == output.size()) break;
            int best = -1;
            for (int id = 0; id < tokenizer.vocab_size(); ++id)
                if (const std::string* b = trie->bytes(id); b && output.compare(at, b->size(), *b) == 0 &&
                                                            (best < 0 || b->size() > trie->bytes(best)->size()))
                    best = id;
            REQUIRE(best >= 0);
            state = grammar.advance(state, best);
            at += trie->bytes(best)->size();
        }
        REQUIRE(state >= 0);
        CHECK(grammar.accepts(state));
        CHECK(checked_states > 10);
    }
}

TEST_CASE("the engine samples inside a grammar: choices, JSON that validates, every sampler option, batch invariance") {
    const infer::Model& model = ByteFeeder::model();
    infer::Tokenizer tokenizer = infer::tokenizer_for(model);
    auto trie = std::make_shared<const infer::TokenTrie>(tokenizer);
    infer::ThreadPool pool(2);

    auto choice = std::make_shared<const infer::Grammar>(infer::regex_for_choices({"yes", "no", "maybe so"}), trie, "choice");
    infer::Engine engine(model, pool);
    std::vector<int> ids;
    for (uint64_t seed = 0; seed < 12; ++seed) {
        infer::SamplingParams p = test::seeded(40, seed);
        p.grammar = choice;
        p.top_k = seed % 3 == 0 ? 5 : 0;
        p.top_p = seed % 3 == 1 ? 0.9f : 1.0f;
        p.repetition_penalty = seed % 2 ? 1.3f : 1.0f;
        ids.push_back(engine.add_request(tokenizer.encode("Pick"), p));
    }
    while (engine.has_work()) engine.step();
    for (int id : ids) {
        infer::RequestResult r = *engine.take_result(id);
        CHECK((r.text == "yes" || r.text == "no" || r.text == "maybe so"));
        CHECK(r.finish_reason == infer::FinishReason::Stop);
    }

    // 20 seeded samples at temperature 1 of a schema: each parses and validates (the demo model is random: the
    // grammar alone keeps it in line).
    auto person = std::make_shared<const infer::Grammar>(
        infer::regex_for_json_schema(infer::Json::parse(person_schema)), trie, "person");
    std::vector<int> json_ids;
    for (uint64_t seed = 0; seed < 20; ++seed) {
        infer::SamplingParams p = test::seeded(400, 100 + seed);
        p.grammar = person;
        json_ids.push_back(engine.add_request(tokenizer.encode("Person:"), p));
    }
    while (engine.has_work()) engine.step();
    std::vector<std::string> texts;
    for (int id : json_ids) {
        infer::RequestResult r = *engine.take_result(id);
        CAPTURE(r.text);
        REQUIRE(r.finish_reason == infer::FinishReason::Stop);
        CHECK(test::valid_json(infer::Json::parse(r.text), infer::Json::parse(person_schema)));
        texts.push_back(r.text);
    }

    // Batch invariance: the first sample, alone, is the same text.
    infer::Engine alone(model, pool);
    infer::SamplingParams p = test::seeded(400, 100);
    p.grammar = person;
    const int single = alone.add_request(tokenizer.encode("Person:"), p);
    while (alone.has_work()) alone.step();
    CHECK(alone.take_result(single)->text == texts[0]);

    // generate() (one request, no engine) honours it too.
    infer::GenerationResult g = infer::generate_from_ids(model, pool, tokenizer.encode("Pick"), [&] {
        infer::SamplingParams q = test::greedy(40);
        q.grammar = choice;
        return q;
    }());
    CHECK((g.text == "yes" || g.text == "no" || g.text == "maybe so"));
}

TEST_CASE("logit_bias: -100 bans a token, +100 forces it; ids outside the vocabulary are refused") {
    const infer::Model& model = ByteFeeder::model();
    infer::Tokenizer tokenizer = infer::tokenizer_for(model);
    infer::ThreadPool pool(1);
    const std::vector<int> prompt = tokenizer.encode("Once upon a time");
    infer::GenerationResult plain = infer::generate_from_ids(model, pool, prompt, test::greedy(8));
    REQUIRE(!plain.generated_ids.empty());
    const int favourite = plain.generated_ids[0];
    for (uint64_t seed = 0; seed < 6; ++seed) {
        infer::SamplingParams p = test::seeded(30, seed);
        p.logit_bias = {{favourite, -100.0f}};
        infer::GenerationResult r = infer::generate_from_ids(model, pool, prompt, p);
        CHECK(std::find(r.generated_ids.begin(), r.generated_ids.end(), favourite) == r.generated_ids.end());
    }
    infer::SamplingParams forced = test::greedy(5);
    forced.logit_bias = {{200, 100.0f}};
    CHECK(infer::generate_from_ids(model, pool, prompt, forced).generated_ids == std::vector<int>(5, 200));
    infer::SamplingParams outside = test::greedy(5);
    outside.logit_bias = {{model.config.vocab_size, 1.0f}};
    CHECK(test::error_of([&] { infer::generate_from_ids(model, pool, prompt, outside); }).find("outside the vocabulary") != std::string::npos);
    outside.logit_bias = {{3, 101.0f}};
    CHECK(test::error_of([&] { outside.validate(); }).find("[-100, 100]") != std::string::npos);
}
