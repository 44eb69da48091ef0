// Fuzz targets: one function per parser that meets untrusted bytes (model files, tokenizer files, text, JSON, chat
// templates, API requests). Each takes arbitrary bytes; an infer::Error is the expected answer to a bad input, and
// anything else (a crash, a sanitizer report, a hang, a foreign exception) is a finding. Loaders that read a path get
// the bytes through a scratch file. Used by the deterministic run in `meson test` (test_fuzz.cpp) and by the libFuzzer
// programs (fuzz_main.cpp, `meson setup -Dfuzz=true` with clang).
#pragma once

#include "fuzz_seeds.hpp"
#include "infer.hpp"
#include "chat_template.hpp"
#include "server.hpp"

#include <fstream>
#include <functional>
#include <span>
#include <unistd.h>

namespace fuzz {

// A scratch folder for this process, removed at exit.
inline const std::filesystem::path& scratch() {
    struct Folder {
        std::filesystem::path path;
        Folder() {
            path = std::filesystem::temp_directory_path() / ("infer-fuzz-" + std::to_string(::getpid()));
            std::filesystem::create_directories(path);
        }
        ~Folder() {
            std::error_code ignored;
            std::filesystem::remove_all(path, ignored);
        }
    };
    static Folder folder;
    return folder.path;
}

inline std::filesystem::path write_scratch(const std::string& name, std::span<const uint8_t> data) {
    std::filesystem::path path = scratch() / name;
    std::ofstream(path, std::ios::binary | std::ios::trunc).write(reinterpret_cast<const char*>(data.data()),
                                                                  static_cast<std::streamsize>(data.size()));
    return path;
}

inline std::string as_text(std::span<const uint8_t> data) { return std::string(data.begin(), data.end()); }

// A model that loaded must also run: one short forward pass over its first ids, so that a file whose shapes passed
// the checks but disagree with each other is caught here and not in a user's generate.
inline void run_briefly(const infer::Model& model) {
    static infer::ThreadPool pool(1);
    infer::SamplingParams params;
    params.temperature = 0;
    params.max_tokens = 2;
    params.ignore_eos = true;
    std::vector<int> ids = {0, std::min(1, model.config.vocab_size - 1)};
    infer::generate_from_ids(model, pool, ids, params);
}

// The same tokenizer checks for every vocabulary that loaded: encode a text with specials, decode the ids, stream them.
inline void exercise_tokenizer(const infer::Tokenizer& tokenizer, const std::string& text) {
    std::vector<int> ids = tokenizer.encode(text, true);
    tokenizer.decode(ids);
    infer::TextStream stream(tokenizer);
    for (int id : ids) stream.push(id);
    stream.finish();
}

// ---- the targets ---------------------------------------------------------------------------------------------------

inline void gguf(std::span<const uint8_t> data) {
    std::filesystem::path path = write_scratch("model.gguf", data);
    infer::Model model = infer::load_model(path);
    exercise_tokenizer(infer::load_tokenizer(path), "Hello, world\n<s>a");
    run_briefly(model);
}

// The weights file of a Hugging Face folder, with a valid config.json beside it.
inline void safetensors(std::span<const uint8_t> data) {
    std::filesystem::path folder = scratch() / "hf-weights";
    std::filesystem::create_directories(folder);
    std::ofstream(folder / "config.json") << tiny_config_json();
    write_scratch("hf-weights/model.safetensors", data);
    run_briefly(infer::load_model(folder));
}

// The config.json of a Hugging Face folder, with valid weights beside it.
inline void config(std::span<const uint8_t> data) {
    std::filesystem::path folder = scratch() / "hf-config";
    std::filesystem::create_directories(folder);
    static bool weights_written = false;
    if (!weights_written) {
        infer::save_safetensors(folder / "model.safetensors", infer::random_weights(tiny_shape(), infer::DType::BF16, 3));
        weights_written = true;
    }
    write_scratch("hf-config/config.json", data);
    run_briefly(infer::load_model(folder));
}

inline void llama2c(std::span<const uint8_t> data) {
    run_briefly(infer::load_model(write_scratch("model.bin", data)));
}

inline void llama2c_tokenizer(std::span<const uint8_t> data) {
    exercise_tokenizer(infer::load_tokenizer(write_scratch("tokenizer.bin", data)), "Once upon a time\n");
}

inline void tokenizer_json(std::span<const uint8_t> data) {
    std::filesystem::path folder = scratch() / "tokenizer-json";
    std::filesystem::create_directories(folder);
    write_scratch("tokenizer-json/tokenizer.json", data);
    exercise_tokenizer(infer::load_tokenizer(folder / "tokenizer.json"), "The theme and the end <|endoftext|> \xC3\xA9!");
}

// Arbitrary text through a SentencePiece vocabulary and a byte-level BPE; the same bytes as ids through decode.
inline void tokenize(std::span<const uint8_t> data) {
    static const infer::Tokenizer sentencepiece = infer::load_tokenizer(write_scratch("seed-sp.gguf", tiny_gguf()));
    static const infer::Tokenizer bpe = [] {
        std::filesystem::create_directories(scratch() / "seed-bpe");
        std::ofstream(scratch() / "seed-bpe" / "tokenizer.json") << tiny_tokenizer_json();
        return infer::load_tokenizer(scratch() / "seed-bpe" / "tokenizer.json");
    }();
    const std::string text = as_text(data);
    for (const infer::Tokenizer* tokenizer : {&sentencepiece, &bpe}) {
        exercise_tokenizer(*tokenizer, text);
        // The bytes as ids, a few of them just outside the vocabulary (an infer::Error names the first).
        std::vector<int> ids;
        for (size_t i = 0; i + 1 < data.size(); i += 2) ids.push_back((data[i] << 8 | data[i + 1]) % (tokenizer->vocab_size() + 4) - 2);
        try {
            tokenizer->decode(ids);
        } catch (const infer::Error&) {
        }
    }
}

inline void json(std::span<const uint8_t> data) { infer::Json::parse(as_text(data), "fuzz input"); }

// The bytes as a chat template, rendered over a fixed conversation; a smaller step budget keeps a case short.
inline void chat_template(std::span<const uint8_t> data) {
    static const infer::Json messages = infer::Json::parse(
        R"([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}])",
        "messages");
    static const infer::Json context = infer::Json::parse(R"({"bos_token": "<s>", "eos_token": "</s>"})", "context");
    chat::TemplateLimits limits;
    limits.max_steps = 200000;
    chat::render(as_text(data), messages, true, context, limits);
}

// The bytes as the JSON body of /v1/completions and /v1/chat/completions, parsed as the server does.
inline void request(std::span<const uint8_t> data) {
    static const infer::Model model = infer::demo_model();
    static const infer::Tokenizer tokenizer = infer::tokenizer_for(model);
    static const std::string source = chat::builtin_template("chatml");
    serve::RequestContext context;
    context.model = &model;
    context.tokenizer = &tokenizer;
    context.render_chat = [](const infer::Json& messages, bool add_generation_prompt, const infer::Json& extra) {
        return chat::render(source, messages, add_generation_prompt, extra);
    };
    static serve::GrammarCache grammars(&tokenizer);  // structured outputs: schemas and expressions from the input too
    context.grammars = &grammars;
    infer::Json body = infer::Json::parse(as_text(data), "request body");
    for (bool is_chat : {false, true}) {
        try {
            serve::CompletionRequest r = serve::parse_request(body, is_chat, context);
            serve::check_fits(r, model.config.context_length, 4096);
        } catch (const infer::Error&) {
            // a 4xx for this endpoint (serve::HttpError is an infer::Error); the other endpoint may still accept it
        }
    }
}

struct Target {
    const char* name;
    void (*run)(std::span<const uint8_t>);
};

inline constexpr Target targets[] = {
    {"gguf", gguf},   {"safetensors", safetensors}, {"config", config}, {"llama2c", llama2c},
    {"llama2c_tokenizer", llama2c_tokenizer},       {"tokenizer_json", tokenizer_json},   {"tokenize", tokenize},
    {"json", json},   {"chat_template", chat_template}, {"request", request},
};

// The seeds of a target, by its name.
inline std::vector<Bytes> seeds_for(const std::string& target) {
    auto bytes_of = [](const std::string& text) { return Bytes(text.begin(), text.end()); };
    std::vector<Bytes> seeds;
    auto add_texts = [&](const std::vector<std::string>& texts) {
        for (const std::string& text : texts) seeds.push_back(bytes_of(text));
    };
    if (target == "gguf") seeds.push_back(tiny_gguf());
    if (target == "safetensors") seeds.push_back(tiny_safetensors(scratch() / "seed.safetensors"));
    if (target == "config") seeds.push_back(bytes_of(tiny_config_json()));
    if (target == "llama2c") seeds.push_back(tiny_llama2c());
    if (target == "llama2c_tokenizer") seeds.push_back(tiny_llama2c_tokenizer());
    if (target == "tokenizer_json") seeds.push_back(bytes_of(tiny_tokenizer_json()));
    if (target == "tokenize") add_texts({"Once upon a time, there was a little girl.", "\xC3\xA9\xF0\x9F\x98\x80 <s> </s>\n\t x"});
    if (target == "json") add_texts(json_seeds());
    if (target == "chat_template") add_texts(template_seeds());
    if (target == "request") add_texts(request_seeds());
    return seeds;
}

// Runs one target on one input. An infer::Error is a bad input refused by name, the expected outcome; any other
// exception escapes to the caller as a finding.
inline void run_one(const Target& target, std::span<const uint8_t> data) {
    try {
        target.run(data);
    } catch (const infer::Error&) {
    }
}

}  // namespace fuzz
