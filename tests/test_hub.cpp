// The Hugging Face hub client (tools/hub.cpp) against a local server that speaks the part of the hub's API it uses:
// the file listing, HEAD/GET of /resolve/ with the hub's headers, LFS files redirected to a storage URL, gated
// repositories. No internet: HF_ENDPOINT points at 127.0.0.1.
#include "support.hpp"

#include "hub.hpp"

#include <httplib.h>

#include <map>
#include <mutex>
#include <set>
#include <thread>

namespace fs = std::filesystem;

namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// Bytes that look like nothing in particular, different for each seed.
std::string noise(size_t size, uint32_t seed) {
    std::string bytes(size, '\0');
    for (char& c : bytes) {
        seed = seed * 1664525u + 1013904223u;
        c = static_cast<char>(seed >> 24);
    }
    return bytes;
}

struct HubFile {
    HubFile(std::string content = "", bool large = false) : bytes(std::move(content)), lfs(large) {}
    std::string bytes;
    bool lfs = false;          // large files: named by sha256, served from the storage URL
    std::string served;        // when set, the storage serves these bytes instead (a corrupted transfer)
};

struct HubRepo {
    std::string commit;
    std::map<std::string, HubFile> files;
    std::string token;  // set: gated, this token gets in; another gets 403, none 401
};

// The fake hub. Requests are counted so the tests can tell what was downloaded and how.
class FakeHub {
public:
    FakeHub() {
        server_.Get(R"(/api/models/([^/]+)/([^/]+)/tree/([^/]+))", [this](const httplib::Request& req, httplib::Response& res) {
            std::lock_guard lock(mutex_);
            HubRepo* repo = find(req, res);
            if (!repo) return;
            std::string json = "[";
            for (const auto& [path, file] : repo->files) {
                json += (json.size() > 1 ? "," : "") + std::string("{\"type\":\"file\",\"oid\":\"") + git_oid(file) +
                        "\",\"size\":" + std::to_string(file.bytes.size()) + ",\"path\":\"" + path + "\"";
                if (file.lfs)
                    json += ",\"lfs\":{\"oid\":\"" + hub::sha256_hex(file.bytes) + "\",\"size\":" + std::to_string(file.bytes.size()) +
                            ",\"pointerSize\":134}";
                json += "}";
            }
            json += ",{\"type\":\"directory\",\"oid\":\"0\",\"size\":0,\"path\":\"docs\"}]";
            res.set_content(json, "application/json");
        });
        server_.Get(R"(/([^/]+)/([^/]+)/resolve/([^/]+)/(.+))", [this](const httplib::Request& req, httplib::Response& res) {
            std::lock_guard lock(mutex_);
            HubRepo* repo = find(req, res);
            if (!repo) return;
            ++resolves[req.method + " " + std::string(req.matches[4])];
            auto file = repo->files.find(req.matches[4]);
            if (file == repo->files.end()) {
                res.status = 404;
                res.set_header("X-Error-Code", "EntryNotFound");
                return;
            }
            res.set_header("X-Repo-Commit", repo->commit);
            if (file->second.lfs) {
                const std::string sha = hub::sha256_hex(file->second.bytes);
                res.set_header("X-Linked-Etag", "\"" + sha + "\"");
                res.set_header("X-Linked-Size", std::to_string(file->second.bytes.size()));
                res.set_header("ETag", "\"" + git_oid(file->second) + "\"");
                res.status = 302;
                res.set_header("Location", storage_origin() + "/storage/" + sha);
                return;
            }
            res.set_header("ETag", "\"" + git_oid(file->second) + "\"");
            res.set_content(file->second.bytes, "application/octet-stream");
        });
        // The storage behind LFS redirects: Range requests answered by httplib (206 with Content-Range).
        server_.Get(R"(/storage/([0-9a-f]+))", [this](const httplib::Request& req, httplib::Response& res) {
            std::lock_guard lock(mutex_);
            ++downloads;
            if (req.has_header("Range")) ranges.push_back(req.get_header_value("Range"));
            if (req.has_header("Authorization")) ++storage_saw_token;
            for (auto& [name, repo] : repos)
                for (auto& [path, file] : repo.files) {
                    if (hub::sha256_hex(file.bytes) != std::string(req.matches[1])) continue;
                    const std::string body = file.served.empty() ? file.bytes : file.served;
                    if (drop_next > 0) {  // send half, then cut the connection
                        --drop_next;
                        auto shared = std::make_shared<std::string>(body);
                        res.set_content_provider(body.size(), "application/octet-stream",
                                                 [shared](size_t offset, size_t, httplib::DataSink& sink) {
                                                     if (offset >= shared->size() / 2) return false;
                                                     sink.write(shared->data(), shared->size() / 2);
                                                     return true;
                                                 });
                        return;
                    }
                    res.set_content(body, "application/octet-stream");
                    return;
                }
            res.status = 404;
        });
        port_ = server_.bind_to_any_port("127.0.0.1");
        thread_ = std::thread([this] { server_.listen_after_bind(); });
        while (!server_.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    ~FakeHub() {
        server_.stop();
        thread_.join();
    }

    std::string origin() const { return "http://127.0.0.1:" + std::to_string(port_); }
    // The storage LFS files redirect to: the same server under another host name, as the hub's storage is another host.
    std::string storage_origin() const { return "http://localhost:" + std::to_string(port_); }

    hub::Settings settings(const fs::path& cache) const {
        hub::Settings settings;
        settings.endpoint = origin();
        settings.cache = cache;
        settings.progress = false;
        settings.retry_delay_seconds = 0;
        return settings;
    }

    std::map<std::string, HubRepo> repos;
    std::map<std::string, int> resolves;  // "HEAD path" → count
    std::vector<std::string> ranges;
    int downloads = 0, drop_next = 0, storage_saw_token = 0;
    std::mutex mutex_;

private:
    static std::string git_oid(const HubFile& file) { return hub::sha256_hex("blob " + file.bytes).substr(0, 40); }

    HubRepo* find(const httplib::Request& req, httplib::Response& res) {
        auto repo = repos.find(std::string(req.matches[1]) + "/" + std::string(req.matches[2]));
        if (repo == repos.end()) {
            res.status = 401;  // as the hub answers an anonymous request for a repository it does not show
            res.set_header("X-Error-Code", "RepoNotFound");
            res.set_header("X-Error-Message", "Repository not found");
            return nullptr;
        }
        if (!repo->second.token.empty()) {
            const std::string auth = req.get_header_value("Authorization");
            if (auth.empty()) {
                res.status = 401;
                res.set_header("X-Error-Code", "GatedRepo");
                res.set_header("X-Error-Message", "Access to model " + repo->first + " is restricted");
                return nullptr;
            }
            if (auth != "Bearer " + repo->second.token) {
                res.status = 403;
                res.set_header("X-Error-Code", "GatedRepo");
                return nullptr;
            }
        }
        return &repo->second;
    }

    httplib::Server server_;
    int port_ = 0;
    std::thread thread_;
};

// A small safetensors model folder (random weights) as a repository, with files the pull must leave alone.
HubRepo tiny_safetensors_repo(const fs::path& scratch) {
    infer::save_random_model(scratch, {.dim = 32, .n_layers = 1, .n_heads = 2, .n_kv_heads = 1, .ffn_dim = 64, .vocab_size = 64,
                                       .context_length = 64}, infer::DType::F32, 7);
    HubRepo repo;
    repo.commit = hub::sha256_hex("tiny commit").substr(0, 40);
    repo.files["config.json"] = {infer::read_text_file(scratch / "config.json")};
    repo.files["model.safetensors"] = {infer::read_text_file(scratch / "model.safetensors"), true};
    repo.files["README.md"] = {"# tiny\n"};
    repo.files["original/consolidated.pth"] = {noise(1000, 1), true};
    return repo;
}

bool no_partial_files(const fs::path& folder) {
    if (!fs::exists(folder)) return true;
    for (const auto& entry : fs::recursive_directory_iterator(folder))
        if (entry.path().extension() == ".incomplete") return false;
    return true;
}

}  // namespace

TEST_CASE("sha256 matches the FIPS 180-4 examples, whole and streamed") {
    CHECK(hub::sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
    CHECK(hub::sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
    CHECK(hub::sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
          "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
    hub::Sha256 streamed;
    const std::string chunk(1001, 'a');
    for (int i = 0; i < 1000; ++i) streamed.update(chunk.data(), i % 2 ? 999 : 1001);  // pieces across block edges
    CHECK(streamed.hex() == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("model names: hf:ORG/NAME, :QUANT and /FILE") {
    hub::ModelReference plain = hub::parse_reference("hf:Qwen/Qwen2.5-0.5B-Instruct");
    CHECK(plain.repo == "Qwen/Qwen2.5-0.5B-Instruct");
    CHECK(plain.quant.empty());
    CHECK(plain.file.empty());
    hub::ModelReference quant = hub::parse_reference("bartowski/SmolLM2-135M-Instruct-GGUF:q4_k_m");
    CHECK(quant.repo == "bartowski/SmolLM2-135M-Instruct-GGUF");
    CHECK(quant.quant == "q4_k_m");
    hub::ModelReference file = hub::parse_reference("hf:karpathy/tinyllamas/stories260K/stories260K.bin");
    CHECK(file.repo == "karpathy/tinyllamas");
    CHECK(file.file == "stories260K/stories260K.bin");
    CHECK(file.text() == "karpathy/tinyllamas/stories260K/stories260K.bin");
    for (const char* bad : {"hf:gpt2", "hf:a/../b", "hf:../x/y", "org/name:", "org/name/../../etc/passwd", "org/na me"})
        CHECK(contains(test::error_of([&] { hub::parse_reference(bad); }), "\""));
}

TEST_CASE("GGUF selection: the quant as a word of the name in any case, else Q4_K_M, then Q8_0, then the first") {
    const std::vector<std::string> listing = {"README.md", "m-IQ4_XS.gguf", "m-Q4_K_M.gguf", "m-Q4_K_S.gguf", "m-Q8_0.gguf",
                                              "mmproj-m-f16.gguf", "m-f16.gguf"};
    CHECK(hub::pick_gguf(listing, "", "o/m") == "m-Q4_K_M.gguf");
    CHECK(hub::pick_gguf(listing, "q8_0", "o/m") == "m-Q8_0.gguf");
    CHECK(hub::pick_gguf(listing, "Q4_K_S", "o/m") == "m-Q4_K_S.gguf");
    CHECK(hub::pick_gguf(listing, "iq4_xs", "o/m") == "m-IQ4_XS.gguf");
    CHECK(hub::pick_gguf(listing, "F16", "o/m") == "m-f16.gguf");  // not the vision projector
    std::string none = test::error_of([&] { hub::pick_gguf(listing, "Q4_K", "o/m"); });  // Q4_K_M and Q4_K_S are other quants
    CHECK(contains(none, "no .gguf file in o/m is quant Q4_K"));
    CHECK(contains(none, "m-Q4_K_M.gguf"));
    CHECK(hub::pick_gguf({"a-Q5_K_M.gguf", "b.Q8_0.gguf"}, "", "o/m") == "b.Q8_0.gguf");
    CHECK(hub::pick_gguf({"b-Q6_K.gguf", "a-Q5_K_M.gguf"}, "", "o/m") == "a-Q5_K_M.gguf");
    // A split file comes with its other parts; a safetensors repository with its index, tokenizer and configs.
    hub::FilePlan split = hub::plan_files(hub::parse_reference("o/m:Q8_0"),
                                          {"m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf", "m-Q4_0.gguf"});
    CHECK(split.files == std::vector<std::string>{"m-Q8_0-00001-of-00002.gguf", "m-Q8_0-00002-of-00002.gguf"});
    CHECK(split.model == "m-Q8_0-00001-of-00002.gguf");
    hub::FilePlan sharded = hub::plan_files(hub::parse_reference("o/m"),
        {"config.json", "generation_config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
         "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json", "vocab.txt", "pytorch_model.bin"});
    CHECK(sharded.files == std::vector<std::string>{"config.json", "model.safetensors.index.json", "tokenizer.json",
                                                    "tokenizer_config.json", "generation_config.json"});
    CHECK(sharded.index == "model.safetensors.index.json");
    CHECK(sharded.model.empty());
    CHECK(contains(test::error_of([] { hub::plan_files(hub::parse_reference("o/m"), {"pytorch_model.bin", "config.json"}); }),
                   "holds neither .gguf files nor config.json with .safetensors weights"));
}

TEST_CASE("a safetensors repository lands in the hub cache layout and loads; a second pull downloads nothing") {
    test::TempDir dir("hub-layout");
    FakeHub fake;
    fake.repos["org/tiny"] = tiny_safetensors_repo(dir / "scratch");
    const HubRepo& repo = fake.repos["org/tiny"];
    const hub::Settings settings = fake.settings(dir / "cache");
    const fs::path path = hub::pull(hub::parse_reference("hf:org/tiny"), settings);

    const fs::path repo_dir = dir / "cache" / "models--org--tiny";
    CHECK(path == repo_dir / "snapshots" / repo.commit);
    CHECK(infer::read_text_file(repo_dir / "refs" / "main") == repo.commit);
    const std::string sha = hub::sha256_hex(repo.files.at("model.safetensors").bytes);
    CHECK(fs::is_regular_file(repo_dir / "blobs" / sha));
    CHECK(fs::is_symlink(path / "model.safetensors"));
    CHECK(fs::read_symlink(path / "model.safetensors") == fs::path("../../blobs") / sha);
    CHECK(fs::is_symlink(path / "config.json"));
    CHECK(infer::read_text_file(path / "config.json") == repo.files.at("config.json").bytes);
    CHECK(!fs::exists(path / "README.md"));                  // not part of the model
    CHECK(!fs::exists(path / "original"));
    CHECK(no_partial_files(repo_dir));
    CHECK(fake.storage_saw_token == 0);
    infer::Model model = infer::load_model(path);
    CHECK(model.config.dim == 32);

    const int downloads = fake.downloads;
    CHECK(hub::pull(hub::parse_reference("org/tiny"), settings) == path);
    CHECK(fake.downloads == downloads);  // the blobs are there: HEAD only
}

TEST_CASE("a dropped connection is resumed with a Range request, also from an earlier run's .incomplete file") {
    test::TempDir dir("hub-resume");
    FakeHub fake;
    fake.repos["org/tiny"] = tiny_safetensors_repo(dir / "scratch");
    const std::string& weights = fake.repos["org/tiny"].files.at("model.safetensors").bytes;
    const std::string sha = hub::sha256_hex(weights);
    fake.drop_next = 1;
    const fs::path path = hub::pull(hub::parse_reference("org/tiny"), fake.settings(dir / "cache"));
    CHECK(infer::read_text_file(path / "model.safetensors") == weights);
    REQUIRE(fake.ranges.size() == 1);
    CHECK(fake.ranges[0] == "bytes=" + std::to_string(weights.size() / 2) + "-");

    // A partial file left by an earlier run (killed, say): only the rest is asked for.
    test::TempDir again("hub-resume-again");
    const fs::path blobs = again / "cache" / "models--org--tiny" / "blobs";
    fs::create_directories(blobs);
    test::write_file(blobs / (sha + ".incomplete"), weights.substr(0, 1000));
    fake.ranges.clear();
    const fs::path second = hub::pull(hub::parse_reference("org/tiny"), fake.settings(again / "cache"));
    CHECK(infer::read_text_file(second / "model.safetensors") == weights);
    CHECK(fake.ranges == std::vector<std::string>{"bytes=1000-"});
    CHECK(no_partial_files(again / "cache"));

    // Cut every time: the error says how far it got and that running again resumes.
    test::TempDir cut("hub-resume-cut");
    fake.drop_next = 100;
    hub::Settings settings = fake.settings(cut / "cache");
    settings.retries = 0;
    std::string error = test::error_of([&] { hub::pull(hub::parse_reference("org/tiny"), settings); });
    CHECK(contains(error, "model.safetensors: the download stopped at " + std::to_string(weights.size() / 2) + " of " +
                              std::to_string(weights.size()) + " bytes"));
    CHECK(contains(error, "run the command again to resume"));
    CHECK(fs::file_size(cut / "cache" / "models--org--tiny" / "blobs" / (sha + ".incomplete")) == weights.size() / 2);
}

TEST_CASE("bytes that do not hash to the hub's sha256 are an error, and nothing of them stays in the cache") {
    test::TempDir dir("hub-checksum");
    FakeHub fake;
    fake.repos["org/tiny"] = tiny_safetensors_repo(dir / "scratch");
    HubFile& weights = fake.repos["org/tiny"].files.at("model.safetensors");
    weights.served = weights.bytes;
    weights.served[weights.served.size() / 3] ^= 1;
    const std::string error = test::error_of([&] { hub::pull(hub::parse_reference("org/tiny"), fake.settings(dir / "cache")); });
    CHECK(contains(error, "model.safetensors: checksum mismatch"));
    CHECK(contains(error, hub::sha256_hex(weights.bytes)));
    CHECK(contains(error, "the download was removed"));
    const fs::path blobs = dir / "cache" / "models--org--tiny" / "blobs";
    for (const auto& entry : fs::directory_iterator(blobs))  // config.json came before; no trace of the weights
        CHECK(entry.path().filename().string().rfind(hub::sha256_hex(weights.bytes), 0) != 0);
}

TEST_CASE("a gated repository: without a token a 401 that says to set HF_TOKEN; with it the files come") {
    test::TempDir dir("hub-gated");
    FakeHub fake;
    fake.repos["meta/gated"] = tiny_safetensors_repo(dir / "scratch");
    fake.repos["meta/gated"].token = "hf_secret";
    hub::Settings settings = fake.settings(dir / "cache");
    std::string error = test::error_of([&] { hub::pull(hub::parse_reference("meta/gated"), settings); });
    CHECK(contains(error, "HTTP 401"));
    CHECK(contains(error, "meta/gated is gated or private"));
    CHECK(contains(error, "set HF_TOKEN"));
    CHECK(contains(error, "restricted"));  // the hub's own words come along
    settings.token = "hf_wrong";
    error = test::error_of([&] { hub::pull(hub::parse_reference("meta/gated"), settings); });
    CHECK(contains(error, "HTTP 403"));
    CHECK(contains(error, "accept its terms on " + fake.origin() + "/meta/gated"));
    settings.token = "hf_secret";
    CHECK(fs::exists(hub::pull(hub::parse_reference("meta/gated"), settings) / "model.safetensors"));
    CHECK(fake.storage_saw_token == 0);  // the token goes to the hub, never to the storage a download is redirected to
}

TEST_CASE("names the hub does not know: the repository or the file, each said plainly") {
    test::TempDir dir("hub-missing");
    FakeHub fake;
    fake.repos["org/tiny"] = tiny_safetensors_repo(dir / "scratch");
    const hub::Settings settings = fake.settings(dir / "cache");
    std::string error = test::error_of([&] { hub::pull(hub::parse_reference("org/nope"), settings); });
    CHECK(contains(error, "org/nope was not found"));
    error = test::error_of([&] { hub::pull(hub::parse_reference("org/tiny/nope.gguf"), settings); });
    CHECK(contains(error, "nope.gguf: not in org/tiny"));
    CHECK(contains(error, "model.safetensors"));  // what it does hold
}

TEST_CASE("a GGUF repository: the requested quant alone is downloaded, the default is Q4_K_M") {
    test::TempDir dir("hub-gguf");
    FakeHub fake;
    HubRepo repo;
    repo.commit = hub::sha256_hex("gguf commit").substr(0, 40);
    uint32_t seed = 0;
    for (const char* name : {"tiny-Q4_K_M.gguf", "tiny-Q8_0.gguf", "tiny-F16.gguf"}) repo.files[name] = {noise(3000, ++seed), true};
    repo.files["README.md"] = {"# gguf\n"};
    fake.repos["org/tiny-GGUF"] = repo;
    const hub::Settings settings = fake.settings(dir / "cache");
    const fs::path q8 = hub::pull(hub::parse_reference("hf:org/tiny-GGUF:q8_0"), settings);
    CHECK(q8.filename() == "tiny-Q8_0.gguf");
    CHECK(infer::read_text_file(q8) == repo.files.at("tiny-Q8_0.gguf").bytes);
    CHECK(fake.downloads == 1);
    CHECK(fake.resolves.count("HEAD tiny-Q4_K_M.gguf") == 0);
    CHECK(hub::pull(hub::parse_reference("org/tiny-GGUF"), settings).filename() == "tiny-Q4_K_M.gguf");
    CHECK(fake.downloads == 2);
    // -hf and -hff as llama.cpp spells them become -m PATH; serve is told the repository's name.
    std::vector<std::string> args = hub::resolve_model_arguments({"infer", "serve", "-hf", "org/tiny-GGUF:Q8_0", "--port", "0"}, settings);
    CHECK(args == std::vector<std::string>{"infer", "serve", "--port", "0", "-m", q8.string(), "--served-model-name", "org/tiny-GGUF"});
    args = hub::resolve_model_arguments({"infer", "generate", "-hf", "org/tiny-GGUF", "-hff", "tiny-F16.gguf"}, settings);
    CHECK(args.back().ends_with("tiny-F16.gguf"));
    args = hub::resolve_model_arguments({"infer", "generate", "--model", "hf:org/tiny-GGUF:Q8_0", "-p", "hi"}, settings);
    CHECK(args == std::vector<std::string>{"infer", "generate", "--model", q8.string(), "-p", "hi"});
    CHECK(contains(test::error_of([&] { hub::resolve_model_arguments({"infer", "generate", "-hff", "x.gguf"}, settings); }),
                   "give -hf too"));
}

TEST_CASE("offline: what the cache holds loads without a request, whoever downloaded it; what it lacks is named") {
    test::TempDir dir("hub-offline");
    FakeHub fake;
    fake.repos["org/tiny"] = tiny_safetensors_repo(dir / "scratch");
    hub::Settings settings = fake.settings(dir / "cache");
    const fs::path online = hub::pull(hub::parse_reference("org/tiny"), settings);
    const int heads = static_cast<int>(fake.resolves.size());
    settings.offline = true;
    CHECK(hub::pull(hub::parse_reference("org/tiny"), settings) == online);
    CHECK(static_cast<int>(fake.resolves.size()) == heads);
    // No server at all (a closed port): the cached copy, with a note saying why.
    hub::Settings unreachable = settings;
    unreachable.offline = false;
    unreachable.endpoint = "http://127.0.0.1:1";
    CHECK(hub::pull(hub::parse_reference("org/tiny"), unreachable) == online);
    std::string error = test::error_of([&] { hub::pull(hub::parse_reference("org/other"), unreachable); });
    CHECK(contains(error, "cannot reach http://127.0.0.1:1"));
    CHECK(contains(error, "no network?"));
    error = test::error_of([&] { hub::pull(hub::parse_reference("org/other"), settings); });
    CHECK(contains(error, "HF_HUB_OFFLINE is set and org/other is not in the hub cache"));

    // A cache as Python's huggingface_hub leaves it (blobs, relative links, refs/main), written here by hand.
    const HubRepo& repo = fake.repos["org/tiny"];
    const fs::path python = dir / "python-cache" / "models--org--py";
    const std::string commit = hub::sha256_hex("python").substr(0, 40);
    fs::create_directories(python / "blobs");
    fs::create_directories(python / "snapshots" / commit);
    fs::create_directories(python / "refs");
    test::write_file(python / "refs" / "main", commit);
    for (const char* file : {"config.json", "model.safetensors"}) {
        const std::string sha = hub::sha256_hex(repo.files.at(file).bytes);
        test::write_file(python / "blobs" / sha, repo.files.at(file).bytes);
        fs::create_symlink(fs::path("../../blobs") / sha, python / "snapshots" / commit / file);
    }
    hub::Settings python_settings = fake.settings(dir / "python-cache");
    python_settings.offline = true;
    const fs::path found = hub::pull(hub::parse_reference("org/py"), python_settings);
    CHECK(found == python / "snapshots" / commit);
    CHECK(infer::load_model(found).config.dim == 32);
    fs::remove(python / "snapshots" / commit / "model.safetensors");
    CHECK(contains(test::error_of([&] { hub::pull(hub::parse_reference("org/py"), python_settings); }),
                   "the cached snapshot of org/py"));
    fs::remove(python / "snapshots" / commit / "config.json");
    fs::create_symlink(fs::path("../../blobs/absent"), python / "snapshots" / commit / "config.json");  // dangling
    fs::create_symlink(fs::path("../../blobs") / hub::sha256_hex(repo.files.at("model.safetensors").bytes),
                       python / "snapshots" / commit / "model.safetensors");
    CHECK(contains(test::error_of([&] { hub::pull(hub::parse_reference("org/py"), python_settings); }),
                   "the cached snapshot of org/py"));
}

TEST_CASE("infer pull and -m hf: from the command line, with HF_ENDPOINT, HF_HOME and HF_HUB_OFFLINE") {
    test::TempDir dir("hub-cli");
    FakeHub fake;
    fake.repos["org/tiny"] = tiny_safetensors_repo(dir / "scratch");
    ::setenv("HF_ENDPOINT", fake.origin().c_str(), 1);
    ::setenv("HF_HOME", (dir / "home").c_str(), 1);
    ::unsetenv("HF_HUB_CACHE");
    ::unsetenv("HF_TOKEN");
    ::unsetenv("HF_HUB_OFFLINE");
    test::ProgramRun pull = test::run_infer({"pull", "org/tiny"});
    CAPTURE(pull.err);
    CHECK(pull.exit_code == 0);
    const std::string snapshot = (dir / "home" / "hub" / "models--org--tiny" / "snapshots" / fake.repos["org/tiny"].commit).string();
    CHECK(pull.out == snapshot + "\n");
    CHECK(contains(pull.err, "downloaded model.safetensors"));  // the progress line (stderr is not a terminal here)

    ::setenv("HF_HUB_OFFLINE", "1", 1);
    test::ProgramRun run = test::run_infer({"generate", "-m", "hf:org/tiny", "--prompt-ids", "1,2,3", "-n", "3", "--temp", "0", "--ids"});
    CAPTURE(run.err);
    CHECK(run.exit_code == 0);
    CHECK(run.out == test::run_infer({"generate", "-m", snapshot, "--prompt-ids", "1,2,3", "-n", "3", "--temp", "0", "--ids"}).out);
    test::ProgramRun missing = test::run_infer({"generate", "-hf", "org/absent", "-p", "hi"});
    CHECK(missing.exit_code == 1);
    CHECK(missing.out.empty());
    CHECK(contains(missing.err, "error: HF_HUB_OFFLINE is set and org/absent is not in the hub cache"));
    ::unsetenv("HF_HUB_OFFLINE");
    ::unsetenv("HF_ENDPOINT");
    ::unsetenv("HF_HOME");
}
