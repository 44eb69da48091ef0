// Hugging Face BPE tokenizers (tokenizer.json and GGUF "gpt2") against ids that Hugging Face's `tokenizers` produced:
// ../shared/tokenizers/<family>/cases.jsonl. Plus the errors for components this tokenizer does not read.
#include "support.hpp"

namespace {

const std::string families[] = {"llama2", "mistral", "llama3", "llama3-instruct", "qwen3", "gpt2"};

std::vector<infer::Json> read_cases(const std::filesystem::path& path) {
    std::vector<infer::Json> cases;
    std::istringstream lines(infer::read_text_file(path));
    for (std::string line; std::getline(lines, line);)
        if (!line.empty()) cases.push_back(infer::Json::parse(line, path.string()));
    return cases;
}

const infer::Tokenizer& tokenizer_of(const std::string& family) {
    static std::map<std::string, infer::Tokenizer> loaded;
    auto found = loaded.find(family);
    if (found == loaded.end()) found = loaded.emplace(family, infer::load_tokenizer(test::shared_dir() / "tokenizers" / family)).first;
    return found->second;
}

// A minimal tokenizer.json around the given components (a few-token byte-level vocabulary).
std::string tokenizer_json(const std::string& normalizer, const std::string& pre_tokenizer, const std::string& decoder,
                           const std::string& model_type = "BPE", const std::string& post = "null") {
    return R"({"version":"1.0","added_tokens":[{"id":3,"content":"<s>","special":true,"normalized":false,"lstrip":false,"rstrip":false,"single_word":false}],)"
           R"("normalizer":)" + normalizer + R"(,"pre_tokenizer":)" + pre_tokenizer + R"(,"post_processor":)" + post +
           R"(,"decoder":)" + decoder + R"(,"model":{"type":")" + model_type +
           R"(","unk_token":null,"vocab":{"a":0,"b":1,"ab":2,"<s>":3},"merges":["a b"]}})";
}

}  // namespace

TEST_CASE("every reference case: ids, ids with special tokens and the raw decode match Hugging Face") {
    REQUIRE_SHARED_OR_SKIP();
    for (const std::string& family : families) {
        const infer::Tokenizer& tokenizer = tokenizer_of(family);
        int passed = 0, total = 0;
        for (const infer::Json& c : read_cases(test::shared_dir() / "tokenizers" / family / "cases.jsonl")) {
            const std::string& text = c.at("text").as_string();
            CAPTURE(family);
            CAPTURE(text);
            std::vector<int> ids = tokenizer.encode(text, false);
            std::vector<int> expected = test::ids_of(c.at("ids"));
            CHECK(ids == expected);
            CHECK(tokenizer.encode(text, true) == test::ids_of(c.at("ids_with_special")));
            std::string decoded = tokenizer.decode(expected);
            CHECK(decoded == c.at("decoded").as_string());
            ++total;
            passed += ids == expected && decoded == c.at("decoded").as_string() &&
                      tokenizer.encode(text, true) == test::ids_of(c.at("ids_with_special"));
        }
        MESSAGE(family << ": " << passed << " of " << total << " cases match");
    }
}

TEST_CASE("the incremental decoder, fed one id at a time, gives the full decode and never splits a character") {
    REQUIRE_SHARED_OR_SKIP();
    for (const std::string& family : families) {
        const infer::Tokenizer& tokenizer = tokenizer_of(family);
        for (const infer::Json& c : read_cases(test::shared_dir() / "tokenizers" / family / "cases.jsonl")) {
            CAPTURE(family);
            CAPTURE(c.at("text").as_string());
            std::vector<int> ids = test::ids_of(c.at("ids_with_special"));
            std::string streamed = test::stream_decode(tokenizer, ids);
            CHECK(streamed == tokenizer.decode(ids));
        }
    }
}

TEST_CASE("special tokens, chat templates and BOS/EOS come from tokenizer_config.json") {
    REQUIRE_SHARED_OR_SKIP();
    const infer::Tokenizer& llama2 = tokenizer_of("llama2");
    CHECK(llama2.bos_id() == 1);
    CHECK(llama2.bos_token() == "<s>");
    CHECK(llama2.eos_ids() == std::vector<int>{2});
    CHECK(llama2.vocab_size() == 32000);
    CHECK(llama2.token_text(29871) == "\xE2\x96\x81");
    const infer::Tokenizer& instruct = tokenizer_of("llama3-instruct");
    CHECK(instruct.eos_token() == "<|eot_id|>");
    CHECK(instruct.eos_ids() == std::vector<int>{128009});
    CHECK(instruct.chat_template().find("start_header_id") != std::string::npos);
    const infer::Tokenizer& qwen = tokenizer_of("qwen3");
    CHECK(qwen.bos_id() == -1);
    CHECK(qwen.eos_token() == "<|im_end|>");
    CHECK(qwen.encode("<|im_start|>user\nhi<|im_end|>", false).front() == 151644);
    CHECK(tokenizer_of("gpt2").chat_template().empty());
    // A tokenizer.json file path works as well as its folder.
    CHECK(infer::load_tokenizer(test::shared_dir() / "tokenizers/gpt2/tokenizer.json").encode("Hello world", false) ==
          std::vector<int>{15496, 995});
}

TEST_CASE("tokenizer_for gives the model's real tokenizer: GGUF llama and llama2.c tokenizer.bin") {
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models" / "stories260K";
    infer::Tokenizer from_gguf = infer::load_tokenizer(dir / "stories260K.gguf");
    infer::Tokenizer from_bin = infer::load_tokenizer(dir / "tok512.bin");
    CHECK(from_bin.vocab_size() == 512);
    CHECK(from_gguf.encode("Once upon a time", true) == from_bin.encode("Once upon a time", true));
    CHECK(from_gguf.kind() == infer::Tokenizer::Kind::SentencePieceScores);
}

TEST_CASE("invalid UTF-8 is an error naming the byte offset") {
    REQUIRE_SHARED_OR_SKIP();
    for (std::string family : {"llama2", "llama3", "qwen3"}) {
        const infer::Tokenizer& tokenizer = tokenizer_of(family);
        CHECK(test::error_of([&] { tokenizer.encode("ok \xC3\x28 bad"); }).find("byte offset 3") != std::string::npos);
        CHECK(test::error_of([&] { tokenizer.encode("abc\xF0\x9F\x98"); }).find("byte offset 3") != std::string::npos);
    }
}

TEST_CASE("components and options this tokenizer does not read are errors that name them") {
    test::TempDir dir("hf-unsupported");
    auto error_for = [&](const std::string& json) {
        test::write_file(dir / "tokenizer.json", json);
        return test::error_of([&] { infer::load_tokenizer(dir / "tokenizer.json"); });
    };
    // The minimal file itself loads and merges.
    test::write_file(dir / "tokenizer.json", tokenizer_json("null", "null", "null"));
    CHECK(infer::load_tokenizer(dir.path()).encode("ab<s>a", false) == std::vector<int>{2, 3, 0});

    CHECK(error_for(tokenizer_json(R"({"type":"NFKC"})", "null", "null")).find("normalizer \"NFKC\"") != std::string::npos);
    CHECK(error_for(tokenizer_json("null", R"({"type":"Whitespace"})", "null")).find("pre_tokenizer \"Whitespace\"") != std::string::npos);
    CHECK(error_for(tokenizer_json("null", "null", R"({"type":"WordPiece","prefix":"##","cleanup":true})"))
              .find("decoder \"WordPiece\"") != std::string::npos);
    CHECK(error_for(tokenizer_json("null", "null", "null", "Unigram")).find("model type \"Unigram\"") != std::string::npos);
    CHECK(error_for(tokenizer_json("null", "null", "null", "BPE", R"({"type":"BertProcessing"})"))
              .find("post_processor \"BertProcessing\"") != std::string::npos);
    CHECK(error_for(tokenizer_json("null", R"({"type":"Split","pattern":{"Regex":"a"},"behavior":"MergedWithNext","invert":false})", "null"))
              .find("Split behavior \"MergedWithNext\"") != std::string::npos);
    // Regex constructs outside the supported subset name the construct.
    std::string message = error_for(tokenizer_json("null", R"({"type":"Split","pattern":{"Regex":"(?<=a)b"},"behavior":"Isolated","invert":false})", "null"));
    CHECK(message.find("unsupported regex construct") != std::string::npos);
    CHECK(message.find("(?<=a)b") != std::string::npos);
    CHECK(error_for(tokenizer_json("null", R"({"type":"Split","pattern":{"Regex":"\\p{Lu}+"},"behavior":"Isolated","invert":false})", "null"))
              .find("\\p{Lu}") != std::string::npos);
    // Every message names the file.
    CHECK(message.find((dir / "tokenizer.json").string()) != std::string::npos);
    CHECK(test::error_of([&] { infer::load_tokenizer(dir / "missing"); }).find("missing") != std::string::npos);
}

TEST_CASE("the regex subset: leftmost-first alternation, backtracking, classes, counted repeats, case folding") {
    using infer::detail::Regex;
    auto matches = [](const std::string& pattern, const std::string& text) {
        std::vector<std::string> out;
        std::u32string cps = infer::detail::to_code_points(text);
        for (auto [b, e] : Regex(pattern).find_all(cps)) {
            std::string piece;
            for (size_t i = b; i < e; ++i) infer::detail::append_utf8(piece, cps[i]);
            out.push_back(piece);
        }
        return out;
    };
    CHECK(matches("a|ab", "ab") == std::vector<std::string>{"a"});  // leftmost-first, not longest
    CHECK(matches(R"(\s+(?!\S)|\s+)", "a   b") == std::vector<std::string>{"  ", " "});
    CHECK(matches(R"(\p{N}{1,3})", "12345") == std::vector<std::string>{"123", "45"});
    CHECK(matches(R"((?i:'s|'t))", "IT'S it'ſ") == std::vector<std::string>{"'S", "'ſ"});
    CHECK(matches(R"([^\r\n\p{L}\p{N}]?\p{L}+)", " héllo wörld") == std::vector<std::string>{" héllo", " wörld"});
    CHECK(matches("(ab)*c", "ababcx") == std::vector<std::string>{"ababc"});
}

TEST_CASE("NFC composes and reorders as Unicode says") {
    CHECK(infer::detail::nfc("e\xCC\x81") == "\xC3\xA9");                   // e + combining acute → é
    CHECK(infer::detail::nfc("\xE1\x84\x80\xE1\x85\xA1") == "\xEA\xB0\x80");  // Hangul L + V → 가
    CHECK(infer::detail::nfc("a\xCC\xA3\xCC\x87") == "\xE1\xBA\xA1\xCC\x87");  // a + dot below + dot above → ạ̇
    CHECK(infer::detail::nfc("\xE2\x84\xAB") == "\xC3\x85");                  // Å (angstrom sign) → Å
}

TEST_CASE("a GGUF gpt2 vocabulary (built here) tokenizes as byte-level BPE with BOS, merges and specials") {
    // A GGUF v3 file with only tokenizer metadata: 6 tokens, 2 merges, pre "gpt-2", BOS added.
    std::string bytes = "GGUF";
    auto u32 = [&](uint32_t v) { bytes.append(reinterpret_cast<const char*>(&v), 4); };
    auto u64 = [&](uint64_t v) { bytes.append(reinterpret_cast<const char*>(&v), 8); };
    auto str = [&](const std::string& s) { u64(s.size()); bytes += s; };
    const std::vector<std::string> tokens = {"<|bos|>", "h", "i", "\xC4\xA0", "hi", "\xC4\xA0hi"};  // Ġ = space
    u32(3);
    u64(0);   // tensors
    u64(9);   // metadata entries
    str("general.architecture"), u32(8), str("llama");
    str("tokenizer.ggml.model"), u32(8), str("gpt2");
    str("tokenizer.ggml.pre"), u32(8), str("gpt-2");
    str("tokenizer.ggml.tokens"), u32(9), u32(8), u64(tokens.size());
    for (const auto& t : tokens) str(t);
    str("tokenizer.ggml.token_type"), u32(9), u32(5), u64(tokens.size());
    for (size_t i = 0; i < tokens.size(); ++i) u32(i == 0 ? 3 : 1);
    str("tokenizer.ggml.merges"), u32(9), u32(8), u64(2);
    str("h i"), str("\xC4\xA0 hi");
    str("tokenizer.ggml.bos_token_id"), u32(4), u32(0);
    str("tokenizer.ggml.add_bos_token"), u32(7), bytes += '\1';
    str("tokenizer.chat_template"), u32(8), str("{{ messages }}");
    test::TempDir dir("gguf-gpt2");
    test::write_file(dir / "vocab.gguf", bytes);
    infer::Tokenizer tokenizer = infer::load_tokenizer(dir / "vocab.gguf");
    CHECK(tokenizer.kind() == infer::Tokenizer::Kind::Bpe);
    CHECK(tokenizer.encode("hi hi<|bos|>", true) == std::vector<int>{0, 4, 5, 0});
    CHECK(tokenizer.encode("hi hi", false) == std::vector<int>{4, 5});
    CHECK(tokenizer.decode(std::vector<int>{4, 5}) == "hi hi");
    CHECK(tokenizer.chat_template() == "{{ messages }}");
    CHECK(tokenizer.bos_token() == "<|bos|>");

    // An unknown tokenizer.ggml.pre is refused by name.
    std::string unknown = bytes;
    size_t at = unknown.find("gpt-2");
    unknown.replace(at, 5, "zzz-9");
    test::write_file(dir / "unknown.gguf", unknown);
    CHECK(test::error_of([&] { infer::load_tokenizer(dir / "unknown.gguf"); }).find("tokenizer.ggml.pre \"zzz-9\"") != std::string::npos);
}

TEST_CASE("every tokenizer.json converted to a GGUF vocabulary tokenizes every reference case as Hugging Face does") {
    REQUIRE_SHARED_OR_SKIP();
    test::TempDir dir("gguf-vocab");
    for (const std::string& family : families) {
        const auto folder = test::shared_dir() / "tokenizers" / family;
        const infer::ConvertedVocabulary converted = infer::vocabulary_from_tokenizer_json(folder);
        CHECK(converted.vocab.model_name == (family == "llama2" || family == "mistral" ? "llama" : "gpt2"));
        // What `infer quantize` writes for a folder: the metadata alone, read back as any GGUF file is.
        auto metadata = infer::detail::gguf_vocabulary_metadata(converted.vocab, converted.bos_id, converted.eos_ids);
        metadata["general.architecture"] = infer::detail::GgufValue{std::string("llama"), infer::detail::STRING, 0};
        const auto path = dir / (family + ".gguf");
        infer::write_gguf(path, metadata, {}, 32);
        const infer::Tokenizer tokenizer = infer::load_tokenizer(path);
        const infer::Tokenizer& reference = tokenizer_of(family);
        CHECK(tokenizer.bos_token() == reference.bos_token());
        CHECK(tokenizer.chat_template() == reference.chat_template());
        // Two differences are GGUF's own, and llama.cpp's: it stores no normalizer (Qwen's NFC changes only text that is
        // not already NFC, so those cases are left out), and a SentencePiece vocabulary's control tokens decode to
        // nothing (only the decode of cases that hold one is left out).
        const bool sentencepiece = converted.vocab.model_name == "llama";
        CHECK(converted.notes.size() == (family == "qwen3" ? 1u : 0u));
        int passed = 0, total = 0;
        for (const infer::Json& c : read_cases(folder / "cases.jsonl")) {
            const std::string& text = c.at("text").as_string();
            if (family == "qwen3" && infer::detail::nfc(text) != text) continue;
            const std::vector<int> ids = test::ids_of(c.at("ids"));
            const bool has_control = std::any_of(ids.begin(), ids.end(), [&](int id) {
                return converted.vocab.types[static_cast<size_t>(id)] == infer::Vocabulary::Type::Control;
            });
            CAPTURE(family);
            CAPTURE(text);
            const bool same = tokenizer.encode(text, false) == ids &&
                              tokenizer.encode(text, true) == test::ids_of(c.at("ids_with_special")) &&
                              (tokenizer.decode(ids) == c.at("decoded").as_string() || (sentencepiece && has_control));
            CHECK(same);
            passed += same;
            ++total;
        }
        MESSAGE(family << " as a GGUF \"" << converted.vocab.model_name << "\" vocabulary: " << passed << " of " << total
                       << " cases match");
    }
}

TEST_CASE("hostile tokenizer.json: token ids that are negative, huge or past an int are refused by name") {
    test::TempDir dir("hostile-json");
    auto with_added_id = [&](const std::string& id) {
        return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}, "merges": []},
                   "added_tokens": [{"id": )" + id + R"(, "content": "<x>", "special": true}]})";
    };
    for (std::string id : {"-1", "1000000000", "2147483647", "1.5"}) {
        CAPTURE(id);
        test::write_file(dir / "tokenizer.json", with_added_id(id));
        std::string message = test::error_of([&] { infer::load_tokenizer(dir / "tokenizer.json"); });
        CHECK(message.find("tokenizer.json") != std::string::npos);
        CHECK(message.find("added token") != std::string::npos);
    }
    test::write_file(dir / "tokenizer.json", R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 99999999}, "merges": []}})");
    CHECK(test::error_of([&] { infer::load_tokenizer(dir / "tokenizer.json"); }).find("vocab token \"b\" has id 99999999") != std::string::npos);
}
