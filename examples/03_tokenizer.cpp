// 03_tokenizer — the tokenizer layer at work on real vocabularies: BPE one merge at a time, SentencePiece-style vs
// byte-level, what a mismatched vocabulary does to a prompt, and what tokenizing costs next to the forward pass.
//
//   03_tokenizer --tokenizers DIR [-m MODEL] [--megabytes N] [-t THREADS]
//
// DIR holds tokenizer folders (llama2, mistral, llama3, …) as ../shared/tokenizers does. Chapter 03 walks through it.
#include "command_line.hpp"
#include "infer.hpp"

#include <cstdio>
#include <iostream>

namespace {

// Shows a token's text with the byte-level and SentencePiece space markers spelled out, so a reader sees the spaces.
std::string shown(const std::string& token) { return "[" + token + "]"; }

// Decoded text with its control characters (C0, DEL and C1: U+0080–U+009F, which a wrong vocabulary's pieces can
// hold) written as \uXXXX escapes, so they neither vanish nor garble the terminal.
std::string printable(const std::string& text) {
    std::string out;
    for (size_t i = 0; i < text.size(); ++i) {
        const auto byte = static_cast<unsigned char>(text[i]);
        const auto next = i + 1 < text.size() ? static_cast<unsigned char>(text[i + 1]) : 0;
        unsigned code = 0x100;  // none
        if (byte < 0x20 || byte == 0x7f) code = byte;
        else if (byte == 0xc2 && next >= 0x80 && next < 0xa0) code = next, ++i;
        if (code == 0x100) {
            out += text[i];
            continue;
        }
        char escape[8];
        std::snprintf(escape, sizeof escape, "\\u%04X", code);
        out += escape;
    }
    return out;
}

void print_tokens(const infer::Tokenizer& tokenizer, const std::vector<int>& ids) {
    for (int id : ids) std::printf("%s", shown(tokenizer.token_text(id)).c_str());
    std::printf("\n   ids:");
    for (int id : ids) std::printf(" %d", id);
    std::printf("\n");
}

// Mixed text for the speed test: every case of every reference file (English, code, numbers, other scripts, emoji),
// repeated until it reaches the requested size.
std::string mixed_text(const std::filesystem::path& dir, size_t bytes) {
    std::string sample;
    for (const char* name : {"llama2", "llama3", "qwen3", "gpt2"}) {
        std::ifstream cases(dir / name / "cases.jsonl");
        std::string line;
        while (std::getline(cases, line)) sample += infer::Json::parse(line).at("text").as_string() + "\n";
    }
    if (sample.empty()) infer::fail(dir.string(), ": no cases.jsonl texts to build the speed-test text from");
    std::string text;
    while (text.size() < bytes) text += sample;
    return text;
}

// Milliseconds of one decode step of `model`: a short prompt, then a few one-token steps.
double decode_step_ms(const infer::Model& model, infer::ThreadPool& pool) {
    infer::ForwardPass forward(model, pool);
    infer::KVCache cache(model.config, 4, 16);
    cache.reserve(0, 40);
    infer::Batch batch;
    for (int i = 0; i < 8; ++i) batch.add(1 + i, i, 0, i == 7);
    forward.forward(batch, cache);
    infer::Stopwatch clock;
    const int steps = 32;
    for (int i = 8; i < 8 + steps; ++i) {
        batch.clear();
        batch.add(1 + i % (model.config.vocab_size - 1), i, 0, true);
        forward.forward(batch, cache);
    }
    return clock.seconds() * 1e3 / steps;
}

}  // namespace

int main(int argc, char** argv) try {
    CommandLine line(argc, argv, 1, {"--tokenizers", "-m", "--megabytes", "-t"}, {},
                     "usage: 03_tokenizer --tokenizers DIR [-m MODEL] [--megabytes N] [-t THREADS]\n");
    if (!line.has("--tokenizers")) infer::fail("03_tokenizer needs --tokenizers DIR (e.g. ../shared/tokenizers)");
    const std::filesystem::path dir = line.text("--tokenizers");
    const size_t megabytes = static_cast<size_t>(line.integer("--megabytes", 1, 1, 1024));
    infer::Tokenizer llama2 = infer::load_tokenizer(dir / "llama2");
    infer::Tokenizer mistral = infer::load_tokenizer(dir / "mistral");
    infer::Tokenizer llama3 = infer::load_tokenizer(dir / "llama3");

    // 1. BPE starts from single characters (SentencePiece-style) or single bytes (byte-level) and applies the merges
    //    it learned, best first, until no learned merge applies.
    std::printf("1. BPE, one merge at a time (Llama 3 vocabulary, the pre-token \" tokenization\")\n\n");
    int step = 0;
    for (const std::vector<std::string>& symbols : llama3.merge_steps(" tokenization")) {
        std::printf("   %2d  ", step++);
        for (const std::string& symbol : symbols) std::printf("%s", shown(symbol).c_str());
        std::printf("\n");
    }

    // 2. Two families spell the same text differently: "▁" marks a space in SentencePiece-style vocabularies; byte-level
    //    ones map every byte to a printable character first (a space becomes "Ġ").
    const std::string sentence = "The café's 12345 items cost $3.50 — 日本";
    std::printf("\n2. One sentence, two families: \"%s\"\n\n   Llama 2 (SentencePiece-style, byte fallback): ",
                sentence.c_str());
    std::vector<int> llama2_ids = llama2.encode(sentence, true);
    print_tokens(llama2, llama2_ids);
    std::printf("   Llama 3 (byte-level, digits in groups of three): ");
    print_tokens(llama3, llama3.encode(sentence, false));

    // 3. The mismatch bug: ids made by one tokenizer, read through another vocabulary of the same size. Nothing fails;
    //    the model just sees a different prompt.
    std::printf("\n3. Llama 2 ids read with the Mistral vocabulary (both 32000 tokens, same format)\n\n");
    std::printf("   Llama 2 decodes them as:  \"%s\"\n", printable(llama2.decode(llama2_ids)).c_str());
    std::printf("   Mistral decodes them as:  \"%s\"\n", printable(mistral.decode(llama2_ids)).c_str());
    int differing = 0;
    for (int id : llama2_ids) differing += llama2.token_text(id) != mistral.token_text(id);
    std::printf("   %d of %zu tokens differ: a Mistral model fed these ids reads the second line.\n", differing,
                llama2_ids.size());

    // 4. Speed: encode at least a megabyte of mixed text; compare with one decode step of a model.
    const std::string text = mixed_text(dir, megabytes << 20);
    std::printf("\n4. Encode speed on %.2f MB of mixed text (English, code, numbers, other scripts, emoji)\n\n",
                static_cast<double>(text.size()) / 1e6);
    std::printf("   %-10s %10s %12s %14s\n", "tokenizer", "MB/s", "tokens", "us per token");
    double llama3_us_per_token = 0;
    for (auto [name, tokenizer] : {std::pair{"Llama 2", &llama2}, std::pair{"Llama 3", &llama3}}) {
        tokenizer->encode(text.substr(0, 100000), false);  // warm the word cache and the allocator
        infer::Stopwatch clock;
        std::vector<int> ids = tokenizer->encode(text, false);
        double seconds = clock.seconds();
        double us_per_token = seconds * 1e6 / static_cast<double>(ids.size());
        if (tokenizer == &llama3) llama3_us_per_token = us_per_token;
        std::printf("   %-10s %10.1f %12zu %14.3f\n", name, static_cast<double>(text.size()) / 1e6 / seconds, ids.size(),
                    us_per_token);
    }
    infer::ThreadPool pool(static_cast<int>(line.integer("-t", 0, 0, 1024)));
    infer::Model model = line.has("-m") ? infer::load_model(line.text("-m")) : infer::demo_model();
    double step_ms = decode_step_ms(model, pool);
    std::printf("\n   one decode step of %s (%.1f M parameters): %.3f ms, %.0f times the Llama 3 tokenizer's time per "
                "token\n",
                model.source.c_str(), static_cast<double>(model.parameter_count()) / 1e6, step_ms,
                step_ms * 1e3 / llama3_us_per_token);
    return 0;
} catch (const std::exception& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
}
