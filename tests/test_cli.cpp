// The infer program: its contracts (--ids JSON, raw logits, make-model) and its errors (message, non-zero exit).
#include "support.hpp"

namespace {
bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

std::string ids_json(const infer::Json& reference) {
    auto list = [](const infer::Json& ids) {
        std::string text;
        for (const infer::Json& id : ids.as_array()) {
            if (!text.empty()) text += ',';
            text += std::to_string(id.as_int());
        }
        return text;
    };
    return "{\"prompt_ids\":[" + list(reference.at("prompt_ids")) + "],\"generated_ids\":[" +
           list(reference.at("generated_ids")) + "]}\n";
}
}  // namespace

TEST_CASE("infer generate --temp 0 --ids reproduces every stories260K reference from both files") {
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models/stories260K";
    for (const char* name : {"empty", "lily_and_ben", "once_upon_a_time", "the_cat"}) {
        infer::Json reference = test::read_json(dir / "public" / (std::string(name) + ".json"));
        for (auto model : {dir / "stories260K.gguf", dir / "stories260K.bin"}) {
            std::vector<std::string> args = {"generate", "-m", model.string(), "-p", reference.at("prompt").as_string(),
                                             "--temp", "0", "-n", "200", "--ids"};
            if (model.extension() == ".bin") args.insert(args.end(), {"--tokenizer", (dir / "tok512.bin").string()});
            test::ProgramRun run = test::run_infer(args);
            CAPTURE(name);
            CAPTURE(model);
            CAPTURE(run.err);
            CHECK(run.exit_code == 0);
            CHECK(run.out == ids_json(reference));
        }
    }
}

TEST_CASE("infer generate --cache-type f16 and bf16 (llama.cpp's -ctk/-ctv) keep stories260K's greedy references") {
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models/stories260K";
    const std::string model = (dir / "stories260K.gguf").string();
    for (const char* name : {"lily_and_ben", "once_upon_a_time"}) {
        infer::Json reference = test::read_json(dir / "public" / (std::string(name) + ".json"));
        const std::vector<std::string> args = {"generate", "-m", model, "-p", reference.at("prompt").as_string(), "--temp", "0",
                                               "-n", "200", "--ids"};
        for (std::vector<std::string> cache : {std::vector<std::string>{"--cache-type", "f16"},
                                               std::vector<std::string>{"-ctk", "bf16", "-ctv", "BF16"}}) {
            std::vector<std::string> with_cache = args;
            with_cache.insert(with_cache.end(), cache.begin(), cache.end());
            test::ProgramRun run = test::run_infer(with_cache);
            CAPTURE(name);
            CAPTURE(cache[1]);
            CAPTURE(run.err);
            CHECK(run.exit_code == 0);
            CHECK(run.out == ids_json(reference));
        }
    }
    test::ProgramRun run = test::run_infer({"generate", "-m", model, "-p", "x", "-ctk", "f16", "-ctv", "f32"});
    CHECK(run.exit_code != 0);
    CHECK(run.out.empty());
    CHECK(run.err == "error: options --cache-type-k f16 and --cache-type-v f32 differ: the KV cache keeps keys and values in one type\n");
    run = test::run_infer({"generate", "-m", model, "-p", "x", "--cache-type", "q8"});
    CHECK(run.err == "error: option --cache-type: \"q8\" is not f32, f16 or bf16\n");
}

TEST_CASE("infer generate --warmup: an untimed pass of the prompt first, the same text and ids, on both paths") {
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models/stories260K";
    const std::string model = (dir / "stories260K.gguf").string();
    infer::Json reference = test::read_json(dir / "public" / "once_upon_a_time.json");
    // The forward pass directly (ids and text), and the engine (a 16-bit cache runs there).
    for (std::vector<std::string> extra : {std::vector<std::string>{"--ids"}, std::vector<std::string>{"--ids", "--cache-type", "f16"}}) {
        std::vector<std::string> args = {"generate", "-m", model, "-p", reference.at("prompt").as_string(), "--temp", "0",
                                         "-n", "200", "--warmup"};
        args.insert(args.end(), extra.begin(), extra.end());
        test::ProgramRun run = test::run_infer(args);
        CAPTURE(run.err);
        CHECK(run.exit_code == 0);
        CHECK(run.out == ids_json(reference));
        CHECK(run.err.find("prefill: ") != std::string::npos);
    }
    for (std::vector<std::string> extra : {std::vector<std::string>{}, std::vector<std::string>{"--cache-type", "f16"}}) {
        std::vector<std::string> text = {"generate", "-m", model, "-p", "Once upon a time", "--temp", "0", "-n", "20"};
        text.insert(text.end(), extra.begin(), extra.end());
        std::vector<std::string> warm = text;
        warm.push_back("--warmup");
        test::ProgramRun cold = test::run_infer(text), warmed = test::run_infer(warm);
        CAPTURE(warmed.err);
        CHECK(warmed.exit_code == 0);
        CHECK(warmed.out == cold.out);  // the prompt echoed once, then the same text
    }
}

TEST_CASE("infer generate --bf16-activations: named in the figures, the same ids on every kernel path, refused where it cannot apply") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string model = (test::shared_dir() / "fixtures/arch/llama/model-bf16/model.gguf").string();
    const std::vector<std::string> args = {"generate", "-m", model, "--prompt-ids", "1,5,70,300,42", "-n", "8", "--temp", "0",
                                           "--ids", "--ignore-eos", "--bf16-activations"};
    auto with_environment = [&](const std::string& variable, const std::vector<std::string>& arguments) {
        std::string command = variable + ' ' + test::quote(std::getenv("INFER_BIN"));
        for (const std::string& arg : arguments) command += ' ' + test::quote(arg);
        return test::run_command(command);
    };
    test::ProgramRun best = test::run_infer(args);
    CAPTURE(best.err);
    CHECK(best.exit_code == 0);
    CHECK(contains(best.err, " kernels, bf16 activations)"));
    test::ProgramRun portable = with_environment("INFER_KERNELS=portable", args);
    CHECK(portable.out == best.out);
    CHECK(contains(portable.err, "note: --bf16-activations runs the portable loop here"));
    std::vector<std::string> plain(args.begin(), args.end() - 1);
    CHECK(with_environment("INFER_BF16_ACTIVATIONS=1", plain).out == best.out);  // the same switch for every command

    std::vector<std::string> on_gpu = args;
    on_gpu.insert(on_gpu.end(), {"--device", "cuda"});
    test::ProgramRun run = test::run_infer(on_gpu);
    CHECK(run.exit_code == 1);
    CHECK(run.err == "error: option --bf16-activations: the CPU kernels' option, not --device cuda\n");
    run = with_environment("INFER_BF16_ACTIVATIONS=yes", plain);
    CHECK(run.exit_code == 1);
    CHECK(run.out.empty());
    CHECK(run.err == "error: INFER_BF16_ACTIVATIONS: \"yes\" is not 0 or 1\n");
}

TEST_CASE("infer generate streams the text and reports tokens/s and the time of each layer") {
    REQUIRE_SHARED_OR_SKIP();
    auto dir = test::shared_dir() / "models/stories260K";
    test::ProgramRun run = test::run_infer({"generate", "-m", (dir / "stories260K.gguf").string(), "-p", "Once upon a time",
                                            "--temp", "0", "-n", "12", "-t", "2"});
    CHECK(run.exit_code == 0);
    CHECK(run.out == "Once upon a time, there was a little girl named Lily. She\n");
    CHECK(contains(run.err, "prompt: 5 tokens, generated: 12 tokens"));
    CHECK(contains(run.err, "decode:"));
    for (const char* layer : {"load", "tokenize", "prefill", "decode", "sample", "detokenize"}) CHECK(contains(run.err, layer));
}

TEST_CASE("infer generate without -m runs the built-in demo model and says so") {
    test::ProgramRun run = test::run_infer({"generate", "-p", "Hello", "-n", "16", "--seed", "1"});
    CHECK(run.exit_code == 0);
    CHECK(contains(run.err, "built-in demo model"));
    CHECK(contains(run.err, "meaningless"));
    CHECK(contains(run.err, "generated: 16 tokens"));
    CHECK(run.out.rfind("Hello", 0) == 0);
    CHECK(test::run_infer({"generate", "-p", "Hello", "-n", "16", "--seed", "1"}).out == run.out);  // a seed repeats
}

TEST_CASE("infer logits writes [n_tokens x vocab] float32 that match the reference") {
    REQUIRE_SHARED_OR_SKIP();
    auto fixture = test::shared_dir() / "fixtures/arch/mistral";
    test::TempDir dir("logits");
    test::ProgramRun run = test::run_infer({"logits", "-m", fixture.string(), "--tokens", "1,5,70,300,42,511,7,9,100,200,300,400",
                                            "--out", (dir / "out.f32").string()});
    REQUIRE(run.exit_code == 0);
    std::vector<float> ours = test::read_floats(dir / "out.f32");
    std::vector<float> reference = test::read_floats(fixture / "logits_A.f32");
    REQUIRE(ours.size() == 12 * 512);
    float worst = 0;
    for (size_t i = 0; i < ours.size(); ++i) worst = std::max(worst, std::fabs(ours[i] - reference[i]));
    CHECK(worst < 1e-4f);
}

TEST_CASE("infer make-model writes a folder that loads and generates") {
    test::TempDir dir("make-model");
    test::ProgramRun run = test::run_infer({"make-model", "-o", (dir / "m").string(), "--dim", "32", "--layers", "2", "--heads",
                                            "4", "--kv-heads", "2", "--ffn", "64", "--vocab", "100", "--dtype", "bf16"});
    CHECK(run.exit_code == 0);
    infer::Model model = infer::load_model(dir / "m");
    CHECK(model.config.dim == 32);
    CHECK(model.config.n_kv_heads == 2);
    CHECK(model.layers[1].w_up.dtype == infer::DType::BF16);
    run = test::run_infer({"generate", "-m", (dir / "m").string(), "--prompt-ids", "1,2,3", "-n", "5", "--ignore-eos", "--ids"});
    CHECK(run.exit_code == 0);
    CHECK(contains(run.out, "\"prompt_ids\":[1,2,3]"));
}

TEST_CASE("errors: the program prints the message and exits non-zero") {
    test::TempDir dir("cli-errors");
    test::ProgramRun run = test::run_infer({"generate", "-m", (dir / "absent.gguf").string(), "-p", "x"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "error: " + (dir / "absent.gguf").string() + ": no such file or folder"));

    test::write_file(dir / "bad.gguf", "GGUX" + std::string(60, '\0'));
    run = test::run_infer({"logits", "-m", (dir / "bad.gguf").string(), "--tokens", "1", "--out", (dir / "o").string()});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "bad magic"));

    run = test::run_infer({"generate", "--top-p", "1.5"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "invalid sampling parameter top_p = 1.5"));

    run = test::run_infer({"generate", "-n", "ten"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "option -n: \"ten\" is not an integer"));

    run = test::run_infer({"generate", "--bogus"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "unknown option \"--bogus\""));

    run = test::run_infer({"generate", "-p", "ok \xFF bad"});
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "invalid UTF-8 in the input text at byte offset 3"));

    if (!test::shared_dir().empty()) {
        std::string long_prompt;
        for (int i = 0; i < 600; ++i) long_prompt += "the cat ";
        auto stories = test::shared_dir() / "models/stories260K";
        run = test::run_infer({"generate", "-m", (stories / "stories260K.bin").string(), "--tokenizer",
                               (stories / "tok512.bin").string(), "-p", long_prompt});
        CHECK(run.exit_code == 1);
        CHECK(contains(run.err, "but the model's context holds 512"));
        run = test::run_infer({"logits", "-m", (test::shared_dir() / "fixtures/arch/llama").string(), "--tokens", "1,999",
                               "--out", (dir / "o").string()});
        CHECK(run.exit_code == 1);
        CHECK(contains(run.err, "token id 999 is outside the vocabulary (512 tokens)"));
    }
    run = test::run_infer({"frobnicate"});
    CHECK(run.exit_code == 2);
    CHECK(contains(run.err, "unknown command \"frobnicate\""));
}

TEST_CASE("infer render-chat reproduces Hugging Face's renderings and ids for every chat family") {
    REQUIRE_SHARED_OR_SKIP();
    for (const char* family : {"llama3", "llama3-instruct", "qwen3"}) {
        auto cases_path = test::shared_dir() / "chat" / family / "chat_cases.jsonl";
        std::string input = infer::read_text_file(cases_path);
        test::ProgramRun run = test::run_infer({"render-chat", "-m", (test::shared_dir() / "tokenizers" / family).string()}, input);
        CAPTURE(run.err);
        std::istringstream expected(input), produced(run.out);
        std::string expected_line, produced_line;
        int cases = 0;
        while (std::getline(expected, expected_line)) {
            REQUIRE(std::getline(produced, produced_line));
            infer::Json want = infer::Json::parse(expected_line), got = infer::Json::parse(produced_line);
            CAPTURE(family);
            CAPTURE(want.at("case").as_string());
            if (want.at("error").is_null()) {
                CHECK(got.at("text").as_string() == want.at("rendered").as_string());
                CHECK(test::ids_of(got.at("ids")) == test::ids_of(want.at("ids")));
            } else {
                CHECK(got.at("error").as_string() == want.at("error").as_string());
            }
            ++cases;
        }
        CHECK(cases == 16);
    }
}

TEST_CASE("infer tokenize and detokenize speak JSON lines and match Hugging Face") {
    REQUIRE_SHARED_OR_SKIP();
    auto folder = test::shared_dir() / "tokenizers" / "llama3-instruct";
    std::string cases = infer::read_text_file(folder / "cases.jsonl");
    test::ProgramRun plain = test::run_infer({"tokenize", "-m", folder.string()}, cases);
    test::ProgramRun special = test::run_infer({"tokenize", "-m", folder.string(), "--special"}, cases);
    CHECK(plain.exit_code == 0);
    std::istringstream expected(cases), got_plain(plain.out), got_special(special.out);
    std::string line, a, b, ids_lines;
    while (std::getline(expected, line)) {
        infer::Json want = infer::Json::parse(line);
        REQUIRE(std::getline(got_plain, a));
        REQUIRE(std::getline(got_special, b));
        CAPTURE(want.at("text").as_string());
        CHECK(test::ids_of(infer::Json::parse(a).at("ids")) == test::ids_of(want.at("ids")));
        CHECK(test::ids_of(infer::Json::parse(b).at("ids")) == test::ids_of(want.at("ids_with_special")));
        ids_lines += a + "\n";
    }
    test::ProgramRun decoded = test::run_infer({"detokenize", "-m", (folder / "tokenizer.json").string()}, ids_lines);
    CHECK(decoded.exit_code == 0);
    std::istringstream expected_again(cases), got_text(decoded.out);
    while (std::getline(expected_again, line)) {
        REQUIRE(std::getline(got_text, a));
        CHECK(infer::Json::parse(a).at("text").as_string() == infer::Json::parse(line).at("decoded").as_string());
    }
    // A bad line gets an error line; the others still get their answer; the exit code reports the failure.
    test::ProgramRun mixed = test::run_infer({"tokenize", "-m", folder.string()}, "{\"text\": \"ok\"}\nnot json\n{\"text\": \"\\ud800\"}\n");
    CHECK(mixed.exit_code == 1);
    CHECK(contains(mixed.out, "{\"ids\":[564]}"));
    CHECK(contains(mixed.out, "stdin line 2: invalid JSON"));
}

TEST_CASE("a model or tokenizer without a chat template says so and names the way out") {
    REQUIRE_SHARED_OR_SKIP();
    std::string request = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"add_generation_prompt\": true}\n";
    test::ProgramRun run = test::run_infer({"render-chat", "-m", (test::shared_dir() / "tokenizers/mistral").string()}, request);
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "has no chat template"));
    CHECK(contains(run.err, "--chat-template"));
    run = test::run_infer({"render-chat", "-m", (test::shared_dir() / "tokenizers/mistral").string(), "--chat-template", "llama2"}, request);
    CHECK(run.exit_code == 0);
    CHECK(contains(run.out, "\"text\":\"<s>[INST] hi [/INST]\""));
    run = test::run_infer({"render-chat", "-m", (test::shared_dir() / "tokenizers/mistral").string(), "--chat-template", "nope"}, request);
    CHECK(run.exit_code == 1);
    CHECK(contains(run.err, "--chat-template nope: neither a built-in template"));
}

TEST_CASE("infer generate takes text for a Hugging Face folder through its tokenizer.json") {
    REQUIRE_SHARED_OR_SKIP();
    // A small random model with Llama 2's 32000-token vocabulary, and Llama 2's tokenizer files beside it.
    test::TempDir dir("hf-text");
    auto folder = dir / "m";
    infer::save_random_model(folder, {.dim = 32, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .ffn_dim = 64,
                                      .vocab_size = 32000, .context_length = 128}, infer::DType::BF16, 9);
    for (const char* file : {"tokenizer.json", "tokenizer_config.json"})
        std::filesystem::copy_file(test::shared_dir() / "tokenizers/llama2" / file, folder / file);
    test::ProgramRun run = test::run_infer({"generate", "-m", folder.string(), "-p", "Hello world", "-n", "3", "--temp", "0",
                                            "--ignore-eos", "--ids"});
    CAPTURE(run.err);
    CHECK(run.exit_code == 0);
    CHECK(contains(run.out, "\"prompt_ids\":[1,15043,3186]"));
}

TEST_CASE("infer chat answers each stdin line through the template, keeping the conversation") {
    REQUIRE_SHARED_OR_SKIP();
    auto model = test::shared_dir() / "models/stories260K/stories260K.gguf";
    test::ProgramRun run = test::run_infer({"chat", "-m", model.string(), "--chat-template", "llama2", "-n", "12", "--temp", "0"},
                                           "Once upon a time\nThe cat\n");
    CAPTURE(run.err);
    CHECK(run.exit_code == 0);
    CHECK(std::count(run.out.begin(), run.out.end(), '\n') == 2);  // one reply per turn
    test::ProgramRun without = test::run_infer({"chat", "-m", model.string()}, "hi\n");
    CHECK(without.exit_code == 1);
    CHECK(contains(without.err, "has no chat template"));
}

// A full disk must not pass for success: every output is written with checked I/O and a failed write exits non-zero.
TEST_CASE("output to a full disk is an error that names the output, never a silent exit 0") {
    const char* bin = std::getenv("INFER_BIN");
    REQUIRE_MESSAGE(bin != nullptr, "INFER_BIN is not set (meson test sets it)");
    test::ProgramRun to_stdout = test::run_command(test::quote(bin) + " generate -p Hello -n 16 --seed 1 > /dev/full");
    CHECK(to_stdout.exit_code != 0);
    CHECK(contains(to_stdout.err, "writing the standard output failed"));

    test::ProgramRun model = test::run_infer({"make-model", "-o", "/dev/full/model"});
    CHECK(model.exit_code != 0);
}

TEST_CASE("run-batch output and trace to a full disk are errors") {
    REQUIRE_SHARED_OR_SKIP();
    const std::string stories = (test::shared_dir() / "models/stories260K/stories260K.gguf").string();
    test::TempDir dir("full");
    test::write_file(dir / "in.jsonl", R"({"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "Hi", "max_tokens": 2}})"
                                       "\n");
    test::ProgramRun batch = test::run_infer({"run-batch", "-m", stories, "-i", (dir / "in.jsonl").string(), "-o", "/dev/full"});
    CHECK(batch.exit_code != 0);
    CHECK(contains(batch.err, "/dev/full: write failed"));
    test::ProgramRun trace = test::run_infer({"run-batch", "-m", stories, "-i", (dir / "in.jsonl").string(), "-o", (dir / "out.jsonl").string(),
                                              "--trace", "/dev/full"});
    CHECK(trace.exit_code != 0);
    CHECK(contains(trace.err, "/dev/full: write failed"));
}

TEST_CASE("llama.cpp's spellings of the common options work, -f reads the prompt, --version prints the version") {
    test::ProgramRun plain = test::run_infer({"generate", "-p", "Hello", "-n", "8", "--seed", "3", "-t", "1"});
    test::ProgramRun aliased = test::run_infer({"generate", "--prompt", "Hello", "--n-predict", "8", "-s", "3", "--threads", "1"});
    CHECK(plain.exit_code == 0);
    CHECK(aliased.exit_code == 0);
    CHECK(aliased.out == plain.out);
    test::TempDir dir("prompt-file");
    test::write_file(dir / "prompt.txt", "Hello");
    CHECK(test::run_infer({"generate", "--file", (dir / "prompt.txt").string(), "-n", "8", "-s", "3", "-t", "1"}).out == plain.out);
    test::ProgramRun version = test::run_infer({"--version"});
    CHECK(version.exit_code == 0);
    CHECK(version.out == std::string("infer ") + INFER_VERSION_STRING + "\n");
}

TEST_CASE("a failed generate prints nothing on stdout, and -n capped by the context says so") {
    test::ProgramRun too_long = test::run_infer({"generate", "-p", std::string(5000, 'a'), "-n", "4"});
    CHECK(too_long.exit_code != 0);
    CHECK(too_long.out.empty());
    CHECK(contains(too_long.err, "error: "));
    REQUIRE_SHARED_OR_SKIP();
    const std::string stories = (test::shared_dir() / "models/stories260K/stories260K.gguf").string();
    test::ProgramRun capped = test::run_infer({"generate", "-m", stories, "-p", "Once upon a time", "-n", "5000", "--ignore-eos",
                                              "--temp", "0"});
    CHECK(capped.exit_code == 0);
    CHECK(contains(capped.err, "tokens -n asked for: the prompt and the output filled the model's context of 2048 tokens"));
}

TEST_CASE("llama.cpp's --model, --repeat-penalty, -c/--ctx-size and -sys/--system") {
    test::TempDir dir("llama-spellings");
    REQUIRE(test::run_infer({"make-model", "-o", (dir / "m").string(), "--dim", "32", "--layers", "1", "--heads", "2",
                             "--ffn", "64", "--vocab", "64", "--context", "64"}).exit_code == 0);
    const std::vector<std::string> request = {"--prompt-ids", "1,2,3", "-n", "4", "--temp", "0", "--ids", "--ignore-eos"};
    auto with = [&](std::vector<std::string> args) {
        args.insert(args.end(), request.begin(), request.end());
        return test::run_infer(args);
    };
    test::ProgramRun plain = with({"generate", "-m", (dir / "m").string()});
    CHECK(plain.exit_code == 0);
    CHECK(with({"generate", "--model", (dir / "m").string()}).out == plain.out);

    test::ProgramRun penalty = test::run_infer({"generate", "-p", "Hello", "-n", "24", "-s", "5", "--repetition-penalty", "1.5"});
    CHECK(penalty.exit_code == 0);
    CHECK(test::run_infer({"generate", "-p", "Hello", "-n", "24", "-s", "5", "--repeat-penalty", "1.5"}).out == penalty.out);

    // -c bounds prompt + output: the demo model's 1024 positions become 16, and the capped -n says so.
    test::ProgramRun bounded = test::run_infer({"generate", "-p", "Hello", "-n", "100", "-s", "1", "--ignore-eos", "-c", "16"});
    CHECK(bounded.exit_code == 0);
    CHECK(contains(bounded.err, "filled the model's context of 16 tokens"));
    CHECK(contains(bounded.err, "prompt: 7 tokens, generated: 9 tokens"));  // 7 + 9 = 16 positions
    CHECK(test::run_infer({"generate", "-p", "Hello", "-n", "100", "-s", "1", "--ignore-eos", "--ctx-size", "16"}).out == bounded.out);
    test::ProgramRun too_short = test::run_infer({"generate", "-p", "Hello", "-c", "4"});
    CHECK(too_short.exit_code == 1);
    CHECK(too_short.out.empty());
    CHECK(contains(too_short.err, "the model's context holds 4"));
    test::ProgramRun too_long = with({"generate", "-m", (dir / "m").string(), "-c", "65"});
    CHECK(too_long.exit_code == 1);
    CHECK(contains(too_long.err, "option -c: 65 positions is more than"));
    CHECK(contains(too_long.err, "was built for (64)"));
    CHECK(test::run_infer({"logits", "-m", (dir / "m").string(), "--tokens", "1,2,3", "--out", (dir / "l.f32").string(),
                           "-c", "2"}).exit_code == 1);  // 3 tokens do not fit in 2 positions

    // -sys: the conversation opens with a system message. This template writes the contents one after another, so
    // the system text followed by the user's reads exactly as the two typed as one user turn.
    REQUIRE_SHARED_OR_SKIP();
    const std::string model = (test::shared_dir() / "models/stories260K/stories260K.gguf").string();
    test::write_file(dir / "concat.jinja", "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}");
    const std::vector<std::string> chat = {"chat", "-m", model, "--chat-template", (dir / "concat.jinja").string(), "-n", "12",
                                           "--temp", "0"};
    auto chat_with = [&](std::vector<std::string> extra, const std::string& input) {
        std::vector<std::string> args = chat;
        args.insert(args.end(), extra.begin(), extra.end());
        return test::run_infer(args, input);
    };
    test::ProgramRun together = chat_with({}, "Once upon a time, there was\n");
    test::ProgramRun system = chat_with({"--system", "Once upon a time"}, ", there was\n");
    CAPTURE(system.err);
    CHECK(system.exit_code == 0);
    CHECK(system.out == together.out);
    CHECK(chat_with({"-sys", "Once upon a time"}, ", there was\n").out == together.out);
}
