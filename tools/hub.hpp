// hub.hpp — models from the Hugging Face hub: `infer pull ORG/NAME`, `-m hf:ORG/NAME[:QUANT|/FILE]` and llama.cpp's
// `-hf ORG/NAME[:QUANT]` / `-hff FILE`. Files land in the hub's own cache layout, so what Python tools downloaded is
// reused and what infer downloads they reuse:
//
//   $HF_HUB_CACHE (default $HF_HOME/hub, $HF_HOME default ~/.cache/huggingface)
//     models--ORG--NAME/
//       blobs/<etag>                      the bytes, named by the hub's ETag (an LFS file's is its sha256)
//       blobs/<etag>.incomplete           a download in progress: resumed with an HTTP Range request
//       snapshots/<commit>/<path>         a relative symlink to ../../blobs/<etag>, one per file of that revision
//       refs/main                         the commit `main` pointed at when last seen
//
// The hub API used: GET /api/models/ORG/NAME/tree/REV?recursive=true lists the files (path, size, and for LFS files
// lfs.oid, their sha256); HEAD /ORG/NAME/resolve/REV/FILE gives the commit (X-Repo-Commit), the blob name
// (X-Linked-Etag, else ETag), the size (X-Linked-Size, else Content-Length) and, for LFS files, a redirect to the
// storage that serves the bytes; GET of that URL downloads them. Environment, as huggingface_hub reads it:
// HF_ENDPOINT, HF_TOKEN (else $HF_HOME/token), HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE=1.
//
// The network half needs cpp-httplib (INFER_HUB_HTTP), and HTTPS needs it built with OpenSSL
// (CPPHTTPLIB_OPENSSL_SUPPORT); without them the cache still answers and the download says what to install.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

namespace hub {

// Where and how to talk to the hub; from_environment() reads what huggingface_hub reads.
struct Settings {
    std::string endpoint = "https://huggingface.co";  // HF_ENDPOINT (a mirror, or a local test server)
    std::string token;                                 // HF_TOKEN, HUGGING_FACE_HUB_TOKEN or the file $HF_HOME/token
    std::filesystem::path cache;                       // the hub cache folder (holds models--ORG--NAME)
    bool offline = false;                              // HF_HUB_OFFLINE=1: the cache only, no request at all
    bool progress = true;                              // a progress line per file on stderr
    int retries = 4;                                   // a dropped download is resumed this many times
    double retry_delay_seconds = 1;                    // times the attempt number, between resumes
    static Settings from_environment();
};

// hf:ORG/NAME[:QUANT|/FILE] without the "hf:": a repository, and which of its files (a GGUF quant, or one file).
struct ModelReference {
    std::string repo;                // ORG/NAME
    std::string quant;               // e.g. Q4_K_M (matched case-insensitively in the .gguf names); "" none asked
    std::string file;                // a path inside the repository; "" to pick the files by the repository's kind
    std::string revision = "main";  // a branch, tag or commit
    std::string text() const;        // back as the user would write it
};
ModelReference parse_reference(std::string_view text);

// What to download for a reference, from the repository's file list (optional files such as generation_config.json
// are in `files` when the list has them); `model` is the path to hand to load_model, relative to the snapshot (""
// for the snapshot folder itself: a safetensors model). A safetensors index names its shards only inside it: `index`
// is set then, and the shards come once it is downloaded.
struct FilePlan {
    std::vector<std::string> files;
    std::string model;
    std::string index;
};
FilePlan plan_files(const ModelReference& reference, const std::vector<std::string>& listing);
// The GGUF file for a quant ("" = the default preference: Q4_K_M, then Q8_0, then the first by name). Throws with the
// quants on offer when none matches.
std::string pick_gguf(const std::vector<std::string>& listing, const std::string& quant, const std::string& repo);
// The shard files a model.safetensors.index.json names (its weight_map's values, each once).
std::vector<std::string> index_shards(const std::filesystem::path& index_file);

// The local path of the model `reference` names (a snapshot folder or a file in it), downloading what is missing.
// Offline (or when the hub cannot be reached and the cache has it) it comes from the cache alone.
std::filesystem::path pull(const ModelReference& reference, const Settings& settings);

// The cache folder of a repository, and the snapshot a revision points at (empty when the cache has none).
std::filesystem::path repo_folder(const Settings& settings, const std::string& repo);
std::filesystem::path cached_snapshot(const Settings& settings, const ModelReference& reference);

// Rewrites a command line: `-m hf:...` / `--model hf:...`, `-hf ORG/NAME[:QUANT]` (--hf-repo) with `-hff FILE`
// (--hf-file) become `-m LOCAL_PATH`, pulling the model first. `serve` also gets --served-model-name ORG/NAME unless
// it has one. Anything else passes through unchanged.
std::vector<std::string> resolve_model_arguments(std::vector<std::string> args, const Settings& settings);

// `infer pull NAME [-hff FILE]`: downloads, prints the local path on stdout.
int run_pull(int argc, char** argv);

// SHA-256 (FIPS 180-4), streamed: what the hub names an LFS file by, checked on every download.
class Sha256 {
public:
    Sha256();
    void update(const void* data, size_t size);
    std::string hex();  // finishes the digest: 64 lowercase hex digits

private:
    void block(const unsigned char* data);
    uint32_t state_[8];
    unsigned char buffer_[64];
    size_t buffered_ = 0;
    uint64_t length_ = 0;
};
std::string sha256_hex(std::string_view bytes);
std::string sha256_file(const std::filesystem::path& path);

}  // namespace hub
