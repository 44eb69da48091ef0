// The SentencePiece score-based tokenizer against llama.cpp's and llama2.c's ids for stories260K's vocabulary.
#include "support.hpp"

namespace {

struct Vocabularies {
    infer::Model gguf, llama2c;
};

const Vocabularies& stories() {
    static Vocabularies models = [] {
        auto dir = test::shared_dir() / "models" / "stories260K";
        return Vocabularies{infer::load_model(dir / "stories260K.gguf"),
                            infer::load_model(dir / "stories260K.bin", dir / "tok512.bin")};
    }();
    return models;
}

}  // namespace

TEST_CASE("encode matches llama.cpp on every reference string, from the GGUF and the llama2.c vocabulary") {
    REQUIRE_SHARED_OR_SKIP();
    infer::Json cases = test::read_json(test::shared_dir() / "models/stories260K/public/tokenizer_cases.json");
    for (const infer::Model* model : {&stories().gguf, &stories().llama2c}) {
        infer::Tokenizer tokenizer = infer::tokenizer_for(*model);
        for (const infer::Json& c : cases.at("cases").as_array()) {
            const std::string& text = c.at("text").as_string();
            CAPTURE(text);
            CAPTURE(model->format);
            CHECK(tokenizer.encode(text, true) == test::ids_of(c.at("llama_cpp_with_bos")));
            CHECK(tokenizer.encode(text, false) == test::ids_of(c.at("llama_cpp_no_bos")));
            CHECK(tokenizer.decode(tokenizer.encode(text, true)) == text);  // SentencePiece round-trips
        }
    }
}

TEST_CASE("the prompts of the generation references tokenize to their prompt ids") {
    REQUIRE_SHARED_OR_SKIP();
    for (const char* name : {"empty", "lily_and_ben", "once_upon_a_time", "the_cat"}) {
        infer::Json reference = test::read_json(test::shared_dir() / "models/stories260K/public" / (std::string(name) + ".json"));
        infer::Tokenizer tokenizer = infer::tokenizer_for(stories().gguf);
        CHECK(tokenizer.encode(reference.at("prompt").as_string()) == test::ids_of(reference.at("prompt_ids")));
    }
}

TEST_CASE("special tokens written in the text become their ids") {
    REQUIRE_SHARED_OR_SKIP();
    infer::Tokenizer tokenizer = infer::tokenizer_for(stories().gguf);
    std::vector<int> ids = tokenizer.encode("a</s>a", false);
    REQUIRE(ids.size() == 3);
    CHECK(ids[0] == 261);  // "▁a"
    CHECK(ids[1] == 2);
    CHECK(ids[2] == 261);  // a dummy-prefix space again after a special token, as llama.cpp
}

TEST_CASE("invalid UTF-8 in the text is an error naming the byte offset") {
    REQUIRE_SHARED_OR_SKIP();
    infer::Tokenizer tokenizer = infer::tokenizer_for(stories().gguf);
    CHECK(test::error_of([&] { tokenizer.encode("ok \xC3\x28 bad"); }).find("byte offset 3") != std::string::npos);
    CHECK(test::error_of([&] { tokenizer.encode("\xED\xA0\x80"); }).find("byte offset 0") != std::string::npos);  // surrogate
    CHECK(test::error_of([&] { tokenizer.encode("abc\xF0\x9F\x98"); }).find("byte offset 3") != std::string::npos);  // cut short
}

TEST_CASE("streaming detokenization equals a full decode and never splits a character") {
    REQUIRE_SHARED_OR_SKIP();
    infer::Tokenizer tokenizer = infer::tokenizer_for(stories().gguf);
    for (std::string text : {"日本 emoji 😀 café", "Once upon a time", "  two", "“quoted” — dash"}) {
        std::vector<int> ids = tokenizer.encode(text, true);
        std::string streamed = test::stream_decode(tokenizer, ids);
        CHECK(streamed == tokenizer.decode(ids));
        CHECK(streamed == text);
    }
    // Bytes that never complete a character become U+FFFD at the end, not garbage.
    infer::TextStream stream(tokenizer);
    std::string out = stream.push(3 + 0xE6);  // the first byte of a three-byte character
    CHECK(out.empty());
    CHECK(stream.finish() == "\xEF\xBF\xBD");
}

TEST_CASE("a model without a SentencePiece vocabulary says so instead of tokenizing") {
    REQUIRE_SHARED_OR_SKIP();
    infer::Model model = infer::load_model(test::shared_dir() / "fixtures/arch/llama");
    std::string message = test::error_of([&] { infer::tokenizer_for(model); });
    CHECK(message.find("fixtures/arch/llama") != std::string::npos);
    CHECK(message.find("token ids") != std::string::npos);
}

TEST_CASE("hostile vocabularies: malformed byte tokens, unknown token types, special ids outside the vocabulary") {
    infer::Vocabulary vocab;
    for (const char* piece : {"<unk>", "<s>", "</s>", "<0x-8>", "a"}) {
        vocab.pieces.push_back(piece);
        vocab.scores.push_back(0);
        vocab.types.push_back(infer::Vocabulary::Type::Normal);
    }
    vocab.types[3] = infer::Vocabulary::Type::Byte;  // a byte token spelled with a negative number
    std::string message = test::error_of([&] { infer::tokenizer_from_vocabulary(vocab, 1, {2}, "hostile.gguf"); });
    CHECK(message.find("hostile.gguf") != std::string::npos);
    CHECK(message.find("<0x-8>") != std::string::npos);
    vocab.pieces[3] = "<0xZZ>";
    CHECK(test::error_of([&] { infer::tokenizer_from_vocabulary(vocab, 1, {2}, "hostile.gguf"); }).find("<0xZZ>") != std::string::npos);
    vocab.types[3] = infer::Vocabulary::Type::Normal;
    CHECK(test::error_of([&] { infer::tokenizer_from_vocabulary(vocab, 1, {9999}, "hostile.gguf"); }).find("EOS id 9999") != std::string::npos);
    CHECK(test::error_of([&] { infer::tokenizer_from_vocabulary(vocab, -7, {2}, "hostile.gguf"); }).find("BOS id -7") != std::string::npos);

    // llama2.c's tokenizer.bin with a "<0x-1>" piece: an ordinary piece, not a byte, and nothing is written out of bounds.
    test::TempDir dir("hostile-vocab");
    std::string bytes;
    auto put = [&](auto value) { bytes.append(reinterpret_cast<const char*>(&value), sizeof value); };
    put(uint32_t{8});
    for (std::string piece : {"<unk>", "\n<s>\n", "\n</s>\n", "<0x-1>", "a"}) {
        put(0.0f);
        put(static_cast<int32_t>(piece.size()));
        bytes += piece;
    }
    test::write_file(dir / "tokenizer.bin", bytes);
    infer::Tokenizer tokenizer = infer::load_tokenizer(dir / "tokenizer.bin");
    const int ids[] = {1, 3, 4};
    CHECK(tokenizer.decode(ids) == "<0x-1>a");
}
