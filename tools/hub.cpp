// hub.cpp — the Hugging Face hub client behind `infer pull` and `-m hf:...` (see hub.hpp for the cache layout and
// the API it speaks).
#include "hub.hpp"

#include "infer.hpp"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <optional>
#include <set>
#include <fcntl.h>
#include <sys/file.h>
#include <thread>
#include <unistd.h>

#ifdef INFER_HUB_HTTP
#include <httplib.h>
#endif

namespace fs = std::filesystem;

namespace hub {
namespace {

// ---- Small helpers ----------------------------------------------------------------------------------------------

std::string lower(std::string text) {
    std::transform(text.begin(), text.end(), text.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
    return text;
}

bool ends_with(const std::string& text, const std::string& tail) {
    return text.size() >= tail.size() && text.compare(text.size() - tail.size(), tail.size(), tail) == 0;
}

std::string environment(const char* name) {
    const char* value = std::getenv(name);
    return value ? value : "";
}

bool is_hex(const std::string& text, size_t length) {
    return text.size() == length &&
           std::all_of(text.begin(), text.end(), [](unsigned char c) { return std::isxdigit(c) && !std::isupper(c); });
}

// A name the server gave that becomes a file name in the cache (an ETag, a commit): no separators, no "..".
std::string cache_name(const std::string& name, const std::string& what) {
    const bool safe = !name.empty() && name != "." && name != ".." && name.size() <= 128 &&
                      std::all_of(name.begin(), name.end(), [](unsigned char c) {
                          return std::isalnum(c) || c == '-' || c == '_' || c == '.';
                      });
    if (!safe) infer::fail("the hub answered with ", what, " \"", name, "\", which cannot name a file in the cache");
    return name;
}

// A path inside a repository as the listing gives it: relative, no "..", so its snapshot link stays in the snapshot.
std::string repo_path(const std::string& path) {
    const fs::path p(path);
    bool safe = !path.empty() && p.is_relative() && path.find('\\') == std::string::npos;
    for (const fs::path& part : p)
        if (part == ".." || part == "." || part.empty()) safe = false;
    if (!safe) infer::fail("the hub listed a file named \"", path, "\", which is not a plain path inside the repository");
    return path;
}

// Percent-encodes a path for a URL, keeping '/' when `keep_slash` (file paths) and encoding it otherwise (revisions
// such as refs/pr/1).
std::string url_encode(const std::string& text, bool keep_slash) {
    static const char digits[] = "0123456789ABCDEF";
    std::string out;
    for (unsigned char c : text) {
        if (std::isalnum(c) || c == '-' || c == '_' || c == '.' || c == '~' || (keep_slash && c == '/')) {
            out += static_cast<char>(c);
        } else {
            out += '%';
            out += digits[c >> 4];
            out += digits[c & 15];
        }
    }
    return out;
}

std::string megabytes(uint64_t bytes) {
    char text[32];
    std::snprintf(text, sizeof text, "%.1f MB", static_cast<double>(bytes) / 1e6);
    return text;
}

// A progress line per file on stderr: redrawn in place on a terminal (at most ten times a second), one summary line
// when stderr is a file or a pipe, so logs stay readable.
class ProgressBar {
public:
    ProgressBar(std::string label, uint64_t total, uint64_t done, bool enabled)
        : label_(std::move(label)), total_(total), start_done_(done), enabled_(enabled), terminal_(::isatty(2)) {}

    void update(uint64_t done, bool force = false) {
        if (!enabled_ || !terminal_) return;
        const auto now = std::chrono::steady_clock::now();
        if (!force && now - last_draw_ < std::chrono::milliseconds(100)) return;
        last_draw_ = now;
        const double fraction = total_ ? static_cast<double>(done) / static_cast<double>(total_) : 1.0;
        const int width = 30, filled = static_cast<int>(fraction * width);
        const double seconds = std::chrono::duration<double>(now - start_).count();
        const double rate = seconds > 0 ? static_cast<double>(done - start_done_) / seconds / 1e6 : 0.0;
        std::string label = label_.size() > 40 ? "..." + label_.substr(label_.size() - 37) : label_;
        std::fprintf(stderr, "\r%-40s %3d%% [%s%s] %s / %s %6.1f MB/s ", label.c_str(), static_cast<int>(fraction * 100),
                     std::string(static_cast<size_t>(filled), '=').c_str(),
                     std::string(static_cast<size_t>(width - filled), ' ').c_str(), megabytes(done).c_str(),
                     megabytes(total_).c_str(), rate);
        std::fflush(stderr);
    }

    void finish(uint64_t done) {
        if (!enabled_) return;
        if (terminal_) {
            update(done, true);
            std::fprintf(stderr, "\n");
            return;
        }
        const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
        std::fprintf(stderr, "downloaded %s: %s in %.1f s\n", label_.c_str(), megabytes(done - start_done_).c_str(), seconds);
    }

private:
    std::string label_;
    uint64_t total_, start_done_;
    bool enabled_, terminal_;
    std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now(), last_draw_{};
};

// ---- HTTP ---------------------------------------------------------------------------------------------------------

// The hub could not be reached at all (no network, no route, no DNS, or no HTTP client built in): the caller may
// still answer from the cache.
struct Unreachable : infer::Error {
    using infer::Error::Error;
};

// One entry of the repository's file list.
struct RepoFile {
    std::string path;
    uint64_t size = 0;
    std::string sha256;  // LFS files only
};

// What HEAD /ORG/NAME/resolve/REV/FILE says about a file.
struct FileMeta {
    std::string commit, etag, location;
    uint64_t size = 0;
    bool found = true;
};

// Why a request failed, in words that say what to do. `what` names the thing asked for.
[[noreturn]] void fail_status(int status, const std::string& error_code, const std::string& error_message,
                              const Settings& settings, const std::string& repo, const std::string& what) {
    const std::string page = settings.endpoint + "/" + repo;
    const std::string detail = error_message.empty() ? "" : " (the hub says: " + error_message + ")";
    if (status == 401) {
        if (settings.token.empty() && error_code == "RepoNotFound")
            infer::fail(what, ": HTTP 401, ", repo, " was not found on ", settings.endpoint, detail,
                        ": check the name (ORG/NAME, as on its page); if it is private, set HF_TOKEN to a token that can see it");
        if (settings.token.empty())
            infer::fail(what, ": HTTP 401, the hub wants a token: ", repo, " is gated or private", detail,
                        ". Create a token at https://huggingface.co/settings/tokens, accept the model's terms on ", page,
                        " if it asks, and set HF_TOKEN to the token");
        infer::fail(what, ": HTTP 401, the hub refused the token in HF_TOKEN for ", repo, detail,
                    ": check the token, and that the repository exists and you can see it at ", page);
    }
    if (status == 403)
        infer::fail(what, ": HTTP 403, the token in HF_TOKEN has no access to ", repo, detail,
                    ": it is gated; accept its terms on ", page, " (and give the token read access)");
    if (status == 404) {
        if (error_code == "RepoNotFound" || error_code.empty())
            infer::fail(what, ": HTTP 404, not found on ", settings.endpoint, detail,
                        error_code == "RepoNotFound" ? ": check the name " + repo + " (ORG/NAME, as on its page)" : "");
        infer::fail(what, ": HTTP 404 (", error_code, ")", detail);
    }
    infer::fail(what, ": HTTP ", status, " from ", settings.endpoint, detail);
}

#ifdef INFER_HUB_HTTP

struct Url {
    std::string origin;  // scheme://host[:port]
    std::string path;    // /path?query
};

Url split_url(const std::string& url) {
    const size_t scheme = url.find("://");
    if (scheme == std::string::npos) infer::fail("\"", url, "\" is not an http:// or https:// URL");
    const size_t slash = url.find('/', scheme + 3);
    if (slash == std::string::npos) return {url, "/"};
    return {url.substr(0, slash), url.substr(slash)};
}

// A redirect's Location: absolute, or relative to the origin it came from.
std::string resolve_location(const Url& from, const std::string& location) {
    if (location.find("://") != std::string::npos) return location;
    if (!location.empty() && location[0] == '/') return from.origin + location;
    return from.origin + from.path.substr(0, from.path.rfind('/') + 1) + location;
}

std::unique_ptr<httplib::Client> client_for(const std::string& origin) {
#ifndef CPPHTTPLIB_OPENSSL_SUPPORT
    if (origin.rfind("https://", 0) == 0)
        throw Unreachable(infer::concat(
            "infer was built without OpenSSL, so it cannot download over HTTPS from ", origin,
            ". Install it (Debian: apt-get install libssl-dev) and rebuild (meson setup --reconfigure build && meson "
            "compile -C build); files already in the hub cache still load (HF_HUB_OFFLINE=1)"));
#endif
    auto client = std::make_unique<httplib::Client>(origin);
    if (!client->is_valid()) infer::fail("cannot make an HTTP client for ", origin);
    client->set_connection_timeout(15);
    client->set_read_timeout(60);
    client->set_follow_location(false);  // redirects are followed here, to drop the token when the host changes
    client->set_decompress(false);        // the bytes as stored: sizes, ranges and hashes are of those
    return client;
}

httplib::Headers request_headers(const Settings& settings, const std::string& origin) {
    // identity: a compressed answer would have another length than the file, and ranges of other bytes.
    httplib::Headers headers = {{"User-Agent", std::string("infer/") + INFER_VERSION_STRING}, {"Accept-Encoding", "identity"}};
    // The token goes to the hub only, never to the storage a download is redirected to.
    if (!settings.token.empty() && split_url(settings.endpoint).origin == origin)
        headers.emplace("Authorization", "Bearer " + settings.token);
    return headers;
}

[[noreturn]] void fail_transport(const Settings& settings, const std::string& url, httplib::Error error) {
    const bool certificate = error == httplib::Error::SSLServerVerification || error == httplib::Error::SSLLoadingCerts;
    throw Unreachable(infer::concat("cannot reach ", split_url(url).origin, " (", httplib::to_string(error),
                                    certificate ? ": its TLS certificate could not be verified; Debian: apt-get install "
                                                  "ca-certificates" : "; no network?",
                                    ") asking for ", url, settings.endpoint == Settings().endpoint
                                        ? "; HF_ENDPOINT can name a mirror" : ""));
}

struct Answer {
    int status = 0;
    httplib::Headers headers;
    std::string body;
    std::string url;  // after the redirects followed
};

// GET or HEAD; follows redirects (`follow_absolute`: also to other hosts; else only relative ones, as the hub uses
// for renamed repositories, so a HEAD stops at the storage redirect of an LFS file and reports it).
Answer request(const Settings& settings, const std::string& method, std::string url, bool follow_absolute) {
    for (int hop = 0; hop < 10; ++hop) {
        const Url parts = split_url(url);
        auto client = client_for(parts.origin);
        const httplib::Headers headers = request_headers(settings, parts.origin);
        httplib::Result result = method == "HEAD" ? client->Head(parts.path, headers) : client->Get(parts.path, headers);
        if (!result) fail_transport(settings, url, result.error());
        Answer answer{result->status, result->headers, result->body, url};
        if (answer.status >= 300 && answer.status < 400 && result->has_header("Location")) {
            const std::string location = result->get_header_value("Location");
            const bool relative = location.find("://") == std::string::npos;
            if (relative || follow_absolute) {
                url = resolve_location(parts, location);
                continue;
            }
        }
        return answer;
    }
    infer::fail("too many redirects from ", url);
}

std::string header(const httplib::Headers& headers, const std::string& name) {
    for (const auto& [key, value] : headers)
        if (lower(key) == lower(name)) return value;
    return "";
}

// An ETag without its weak marker and quotes: W/"abc" → abc.
std::string bare_etag(std::string etag) {
    if (etag.rfind("W/", 0) == 0) etag = etag.substr(2);
    if (etag.size() >= 2 && etag.front() == '"' && etag.back() == '"') etag = etag.substr(1, etag.size() - 2);
    return etag;
}

std::string repo_url(const Settings& settings, const std::string& repo) { return settings.endpoint + "/" + repo; }

// GET /api/models/ORG/NAME/tree/REV?recursive=true, page after page (the hub pages large listings with a Link
// header).
std::vector<RepoFile> list_files(const Settings& settings, const ModelReference& reference) {
    std::vector<RepoFile> files;
    std::string url = settings.endpoint + "/api/models/" + reference.repo + "/tree/" + url_encode(reference.revision, false) +
                      "?recursive=true";
    for (int page = 0; page < 1000 && !url.empty(); ++page) {
        Answer answer = request(settings, "GET", url, true);
        if (answer.status != 200)
            fail_status(answer.status, header(answer.headers, "X-Error-Code"), header(answer.headers, "X-Error-Message"),
                        settings, reference.repo, "listing the files of " + reference.repo);
        const infer::Json list = infer::Json::parse(answer.body, "the file list of " + reference.repo);
        if (!list.is_array()) infer::fail("the file list of ", reference.repo, " is not a JSON array");
        for (const infer::Json& entry : list.as_array()) {
            const infer::Json* type = entry.find("type");
            if (!entry.is_object() || !type || !type->is_string() || type->as_string() != "file") continue;
            RepoFile file;
            file.path = repo_path(entry.at("path").as_string());
            if (const infer::Json* size = entry.find("size"); size && size->is_number()) file.size = static_cast<uint64_t>(size->as_int());
            if (const infer::Json* lfs = entry.find("lfs"); lfs && lfs->is_object())
                if (const infer::Json* oid = lfs->find("oid"); oid && oid->is_string()) file.sha256 = oid->as_string();
            files.push_back(std::move(file));
        }
        // Link: <https://huggingface.co/api/models/...&cursor=...>; rel="next"
        url.clear();
        const std::string link = header(answer.headers, "Link");
        const size_t next = link.find("rel=\"next\"");
        if (next != std::string::npos) {
            const size_t open = link.rfind('<', next), close = link.find('>', open);
            if (open != std::string::npos && close != std::string::npos && close < next)
                url = resolve_location(split_url(answer.url), link.substr(open + 1, close - open - 1));
        }
    }
    return files;
}

FileMeta file_meta(const Settings& settings, const std::string& repo, const std::string& revision, const std::string& path) {
    const std::string url = repo_url(settings, repo) + "/resolve/" + url_encode(revision, false) + "/" + url_encode(path, true);
    Answer answer = request(settings, "HEAD", url, false);
    FileMeta meta;
    if (answer.status == 404 && header(answer.headers, "X-Error-Code") != "RepoNotFound") {
        meta.found = false;
        return meta;
    }
    const bool redirect = answer.status >= 300 && answer.status < 400;
    if (answer.status != 200 && !redirect)
        fail_status(answer.status, header(answer.headers, "X-Error-Code"), header(answer.headers, "X-Error-Message"), settings,
                    repo, path + " in " + repo);
    meta.commit = header(answer.headers, "X-Repo-Commit");
    meta.etag = bare_etag(header(answer.headers, "X-Linked-Etag"));
    if (meta.etag.empty()) meta.etag = bare_etag(header(answer.headers, "ETag"));
    std::string size = header(answer.headers, "X-Linked-Size");
    if (size.empty()) size = header(answer.headers, "Content-Length");
    if (!size.empty()) {
        size_t used = 0;
        try {
            meta.size = std::stoull(size, &used);
        } catch (const std::exception&) {
            used = 0;
        }
        if (used != size.size()) infer::fail(path, " in ", repo, ": the hub gave its size as \"", size, "\", not a number");
    }
    meta.location = redirect ? resolve_location(split_url(answer.url), header(answer.headers, "Location")) : answer.url;
    if (meta.commit.empty() || meta.etag.empty())
        infer::fail(path, " in ", repo, ": the answer of ", settings.endpoint,
                    " has no X-Repo-Commit or ETag header; is HF_ENDPOINT a Hugging Face hub?");
    return meta;
}

// Downloads `url` into `partial`, resuming what a dropped connection (this run's or an earlier one's) left there with
// a Range request; checks the size and, for an LFS file, the sha256. On a checksum mismatch the partial file is
// removed, so the next run starts afresh rather than resuming wrong bytes.
void download(const Settings& settings, const std::string& url, const fs::path& partial, uint64_t size,
              const std::string& sha256, const std::string& label) {
    Sha256 hash;
    uint64_t have = 0;
    if (fs::exists(partial)) {
        have = fs::file_size(partial);
        if (have > size) {  // longer than the file can be: not a prefix of it
            fs::remove(partial);
            have = 0;
        } else {
            std::ifstream in(partial, std::ios::binary);
            std::vector<char> buffer(1 << 20);
            while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0)
                hash.update(buffer.data(), static_cast<size_t>(in.gcount()));
        }
    }
    { std::ofstream touch(partial, std::ios::binary | std::ios::app); }  // exists even for a file of 0 bytes
    ProgressBar progress(label, size, have, settings.progress);
    std::string last_error;
    for (int attempt = 0; attempt <= settings.retries && have < size; ++attempt) {
        if (attempt > 0)
            std::this_thread::sleep_for(std::chrono::duration<double>(settings.retry_delay_seconds * attempt));
        std::ofstream out(partial, std::ios::binary | std::ios::app);
        if (!out) infer::fail(partial.string(), ": cannot write (", std::strerror(errno), ")");
        std::string current = url;
        bool retry = false;
        for (int hop = 0; hop < 10; ++hop) {
            const Url parts = split_url(current);
            auto client = client_for(parts.origin);
            httplib::Headers headers = request_headers(settings, parts.origin);
            if (have > 0) headers.emplace("Range", "bytes=" + std::to_string(have) + "-");
            int status = 0;
            std::string location, error_code, error_message;
            bool too_long = false;
            auto on_response = [&](const httplib::Response& response) {
                status = response.status;
                if (status >= 300 && status < 400) {
                    location = response.get_header_value("Location");
                    return false;
                }
                if (status == 200 && have > 0) {  // the server sent the whole file, not the rest: start over
                    out.close();
                    out.open(partial, std::ios::binary | std::ios::trunc);
                    hash = Sha256();
                    have = 0;
                }
                if (status == 206 && response.get_header_value("Content-Range").rfind("bytes " + std::to_string(have) + "-", 0) != 0)
                    return false;  // a range other than the one asked for
                error_code = response.get_header_value("X-Error-Code");
                error_message = response.get_header_value("X-Error-Message");
                return status == 200 || status == 206;
            };
            auto on_data = [&](const char* data, size_t length) {
                if (have + length > size) {
                    too_long = true;
                    return false;
                }
                out.write(data, static_cast<std::streamsize>(length));
                hash.update(data, length);
                have += length;
                progress.update(have);
                return static_cast<bool>(out);
            };
            httplib::Result result = client->Get(parts.path, headers, on_response, on_data);
            out.flush();
            if (!out) infer::fail(partial.string(), ": write failed (", std::strerror(errno), ")");
            if (status >= 300 && status < 400 && !location.empty()) {
                current = resolve_location(parts, location);
                continue;
            }
            if (too_long) {
                out.close();
                fs::remove(partial);
                infer::fail(label, ": the server sent more than the ", size, " bytes the hub announced; the partial ",
                            "download was removed");
            }
            if (status != 0 && status != 200 && status != 206)
                fail_status(status, error_code, error_message, settings, label, "downloading " + label);
            if (status == 206 && !result && result.error() == httplib::Error::Canceled)
                infer::fail(label, ": the server answered a different byte range than asked for");
            if (!result) {  // the connection dropped: keep what came, resume from there
                last_error = httplib::to_string(result.error());
                retry = true;
            }
            break;
        }
        if (!retry && have < size) last_error = "the server closed the transfer early";
    }
    if (have < size) {
        progress.finish(have);
        infer::fail(label, ": the download stopped at ", have, " of ", size, " bytes (", last_error, ") after ",
                    settings.retries + 1, " tries; run the command again to resume from there");
    }
    progress.finish(have);
    if (!sha256.empty()) {
        const std::string got = hash.hex();
        if (got != sha256) {
            fs::remove(partial);
            infer::fail(label, ": checksum mismatch: the hub names the file by sha256 ", sha256, " but the bytes ",
                        "received hash to ", got, "; the download was removed, run the command again");
        }
    }
}

#else  // no cpp-httplib: the cache alone

[[noreturn]] void no_http() {
    throw Unreachable(
        "infer was built without cpp-httplib, so it cannot download from the hub. Install it (Debian: apt-get install "
        "libcpp-httplib-dev libssl-dev) and rebuild (meson setup --reconfigure build && meson compile -C build); files "
        "already in the hub cache still load (HF_HUB_OFFLINE=1)");
}
std::vector<RepoFile> list_files(const Settings&, const ModelReference&) { no_http(); }
FileMeta file_meta(const Settings&, const std::string&, const std::string&, const std::string&) { no_http(); }
void download(const Settings&, const std::string&, const fs::path&, uint64_t, const std::string&, const std::string&) {
    no_http();
}

#endif

// ---- The cache ----------------------------------------------------------------------------------------------------

// An exclusive lock on a blob while it downloads, so two programs pulling the same model at once take turns (the
// second then finds the blob whole) instead of appending to one .incomplete file together. The lock files live in
// .locks/models--ORG--NAME/ beside the repositories, where huggingface_hub keeps its own.
class BlobLock {
public:
    BlobLock(const Settings& settings, const fs::path& blob) {
        const fs::path folder = settings.cache / ".locks" / blob.parent_path().parent_path().filename();
        std::error_code error;
        fs::create_directories(folder, error);
        const fs::path path = folder / (blob.filename().string() + ".lock");
        fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
        if (fd_ >= 0 && ::flock(fd_, LOCK_EX) != 0) {
            ::close(fd_);
            fd_ = -1;
        }
    }
    ~BlobLock() {
        if (fd_ >= 0) ::close(fd_);  // closing releases the lock
    }
    BlobLock(const BlobLock&) = delete;
    BlobLock& operator=(const BlobLock&) = delete;

private:
    int fd_ = -1;
};

fs::path blob_path(const fs::path& repo_dir, const std::string& etag) { return repo_dir / "blobs" / cache_name(etag, "an ETag"); }

// snapshots/<commit>/<path> → ../../blobs/<etag> (one more ../ per folder in path), replacing what was there.
void link_snapshot(const fs::path& snapshot, const std::string& path, const fs::path& blob) {
    const fs::path link = snapshot / path;
    fs::create_directories(link.parent_path());
    fs::path target = fs::path("..") / ".." / "blobs" / blob.filename();
    for (size_t depth = std::count(path.begin(), path.end(), '/'); depth > 0; --depth) target = fs::path("..") / target;
    std::error_code ignored;
    fs::remove(link, ignored);
    std::error_code error;
    fs::create_symlink(target, link, error);
    if (error) fs::copy_file(blob, link, fs::copy_options::overwrite_existing);  // no symlinks here: a copy, as huggingface_hub does
}

std::vector<std::string> snapshot_listing(const fs::path& snapshot) {
    std::vector<std::string> listing;
    for (const fs::directory_entry& entry : fs::recursive_directory_iterator(snapshot)) {
        std::error_code error;
        if (fs::is_regular_file(entry.path(), error))  // follows the link: a dangling one is not a file
            listing.push_back(entry.path().lexically_relative(snapshot).generic_string());
    }
    std::sort(listing.begin(), listing.end());
    return listing;
}

bool listed(const std::vector<std::string>& listing, const std::string& path) {
    return std::find(listing.begin(), listing.end(), path) != listing.end();
}

std::string some_files(const std::vector<std::string>& listing) {
    std::string text;
    for (size_t i = 0; i < listing.size() && i < 12; ++i) text += (i ? ", " : "") + listing[i];
    if (listing.size() > 12) text += ", ... (" + std::to_string(listing.size()) + " files)";
    return listing.empty() ? "none" : text;
}

// The model from the cache alone: the snapshot the revision points at must hold every file the plan needs.
fs::path pull_from_cache(const ModelReference& reference, const Settings& settings, const std::string& why) {
    const fs::path snapshot = cached_snapshot(settings, reference);
    if (snapshot.empty())
        infer::fail(why, reference.text(), " is not in the hub cache (", repo_folder(settings, reference.repo).string(), ")",
                    settings.offline ? ": unset HF_HUB_OFFLINE and run infer pull " + reference.text() + " with the network" : "");
    const std::vector<std::string> listing = snapshot_listing(snapshot);
    FilePlan plan;
    try {
        plan = plan_files(reference, listing);
    } catch (const infer::Error& e) {
        infer::fail(why, "the cached snapshot of ", reference.text(), " (", snapshot.string(), ") does not hold the model: ",
                    e.what(), "; run infer pull ", reference.text(), " with the network to complete it");
    }
    std::vector<std::string> needed = plan.files;
    if (!plan.index.empty()) {
        const std::vector<std::string> shards = index_shards(snapshot / plan.index);
        needed.insert(needed.end(), shards.begin(), shards.end());
    }
    for (const std::string& file : needed)
        if (!listed(listing, file))
            infer::fail(why, "the cached snapshot of ", reference.text(), " lacks ", file, " (", snapshot.string(),
                        "): run infer pull ", reference.text(), " with the network to complete it");
    return plan.model.empty() ? snapshot : snapshot / plan.model;
}

fs::path pull_online(const ModelReference& reference, const Settings& settings) {
    const std::vector<RepoFile> files = list_files(settings, reference);
    std::vector<std::string> listing;
    for (const RepoFile& file : files) listing.push_back(file.path);
    std::sort(listing.begin(), listing.end());
    const FilePlan plan = plan_files(reference, listing);

    const fs::path repo_dir = repo_folder(settings, reference.repo);
    fs::create_directories(repo_dir / "blobs");
    std::string commit;
    // Each file: HEAD for its blob name and the commit, then the blob unless the cache has it whole already
    // (downloaded by this program or by Python's huggingface_hub: the same name means the same bytes).
    auto fetch = [&](const std::string& path) {
        const FileMeta meta = file_meta(settings, reference.repo, commit.empty() ? reference.revision : commit, path);
        if (!meta.found) infer::fail(path, ": not in ", reference.repo, " at ", reference.revision, " (HTTP 404)");
        if (commit.empty()) commit = cache_name(meta.commit, "the commit");
        const fs::path blob = blob_path(repo_dir, meta.etag);
        auto entry = std::find_if(files.begin(), files.end(), [&](const RepoFile& f) { return f.path == path; });
        const uint64_t size = meta.size ? meta.size : (entry != files.end() ? entry->size : 0);
        BlobLock lock(settings, blob);
        std::error_code error;
        if (!fs::exists(blob) || fs::file_size(blob, error) != size) {
            // An LFS file's blob name is its sha256: check the bytes against it (else the listing's lfs.oid).
            std::string sha256 = is_hex(meta.etag, 64) ? meta.etag : (entry != files.end() ? entry->sha256 : "");
            fs::path partial = blob;
            partial += ".incomplete";
            download(settings, meta.location, partial, size, sha256, path);
            fs::rename(partial, blob);
        }
        link_snapshot(repo_dir / "snapshots" / commit, path, blob);
    };
    for (const std::string& file : plan.files) fetch(file);
    if (!plan.index.empty())
        for (const std::string& shard : index_shards(repo_dir / "snapshots" / commit / plan.index)) fetch(repo_path(shard));
    if (reference.revision != commit) {
        fs::create_directories(repo_dir / "refs" / fs::path(reference.revision).parent_path());
        std::ofstream ref(repo_dir / "refs" / reference.revision, std::ios::trunc);
        ref << commit;
        infer::close_written_file(ref, (repo_dir / "refs" / reference.revision).string());
    }
    const fs::path snapshot = repo_dir / "snapshots" / commit;
    return plan.model.empty() ? snapshot : snapshot / plan.model;
}

const char* usage_text = R"(usage: infer pull ORG/NAME[:QUANT | /FILE] [-hff FILE]

Downloads a model from the Hugging Face hub into its cache (as huggingface_hub does, so each reuses the other's
files) and prints its local path. The same names work wherever a model is taken: -m hf:ORG/NAME[:QUANT|/FILE], or
llama.cpp's -hf ORG/NAME[:QUANT] (with -hff FILE).

  ORG/NAME            a safetensors repository: config.json, the weights (model.safetensors, or the index and its
                      shards), tokenizer.json, tokenizer_config.json, generation_config.json
                      a GGUF repository: one .gguf (Q4_K_M if there is one, else Q8_0, else the first)
  ORG/NAME:QUANT      the .gguf whose name carries QUANT (any case): TheBloke/TinyLlama-1.1B-Chat-v1.0-GGUF:Q8_0
  ORG/NAME/FILE       that file (a .bin also brings the tokenizer.bin beside it)

Environment: HF_TOKEN (gated or private repositories), HF_ENDPOINT (a mirror), HF_HOME or HF_HUB_CACHE (the cache,
default ~/.cache/huggingface/hub), HF_HUB_OFFLINE=1 (the cache only).
)";

}  // namespace

// ---- Public API -------------------------------------------------------------------------------------------------

Settings Settings::from_environment() {
    Settings settings;
    if (std::string endpoint = environment("HF_ENDPOINT"); !endpoint.empty()) {
        while (!endpoint.empty() && endpoint.back() == '/') endpoint.pop_back();
        settings.endpoint = endpoint;
    }
    fs::path home;
    if (std::string hf_home = environment("HF_HOME"); !hf_home.empty()) home = hf_home;
    else if (std::string xdg = environment("XDG_CACHE_HOME"); !xdg.empty()) home = fs::path(xdg) / "huggingface";
    else home = fs::path(environment("HOME").empty() ? "." : environment("HOME")) / ".cache" / "huggingface";
    if (std::string cache = environment("HF_HUB_CACHE"); !cache.empty()) settings.cache = cache;
    else if (std::string legacy = environment("HUGGINGFACE_HUB_CACHE"); !legacy.empty()) settings.cache = legacy;
    else settings.cache = home / "hub";
    settings.token = environment("HF_TOKEN");
    if (settings.token.empty()) settings.token = environment("HUGGING_FACE_HUB_TOKEN");
    if (settings.token.empty()) {  // what `huggingface-cli login` / `hf auth login` saved
        fs::path token_file = environment("HF_TOKEN_PATH").empty() ? home / "token" : fs::path(environment("HF_TOKEN_PATH"));
        std::ifstream in(token_file);
        std::getline(in, settings.token);
        while (!settings.token.empty() && std::isspace(static_cast<unsigned char>(settings.token.back()))) settings.token.pop_back();
    }
    const std::string offline = lower(environment("HF_HUB_OFFLINE"));
    settings.offline = offline == "1" || offline == "on" || offline == "yes" || offline == "true";
    return settings;
}

std::string ModelReference::text() const {
    std::string out = repo;
    if (!quant.empty()) out += ":" + quant;
    if (!file.empty()) out += "/" + file;
    return out;
}

ModelReference parse_reference(std::string_view text) {
    std::string rest(text);
    if (rest.rfind("hf:", 0) == 0) rest = rest.substr(3);
    if (rest.rfind("hf://", 0) == 0) rest = rest.substr(5);
    ModelReference reference;
    // ORG/NAME, then either :QUANT or /FILE (a path, which may contain '/').
    const size_t first = rest.find('/');
    const size_t colon = rest.find(':');
    const size_t second = first == std::string::npos ? std::string::npos : rest.find('/', first + 1);
    size_t end = std::min(colon, second);
    reference.repo = rest.substr(0, end);
    if (end != std::string::npos) {
        if (end == colon && (second == std::string::npos || colon < second)) reference.quant = rest.substr(colon + 1);
        else reference.file = rest.substr(second + 1);
    }
    auto name_ok = [](const std::string& part) {
        return !part.empty() && part != "." && part != ".." && part.size() <= 96 &&
               std::all_of(part.begin(), part.end(), [](unsigned char c) { return std::isalnum(c) || c == '-' || c == '_' || c == '.'; });
    };
    const size_t slash = reference.repo.find('/');
    if (slash == std::string::npos || !name_ok(reference.repo.substr(0, slash)) || !name_ok(reference.repo.substr(slash + 1)))
        infer::fail("\"", std::string(text), "\" does not name a Hugging Face repository: write ORG/NAME, ORG/NAME:QUANT or ",
                    "ORG/NAME/FILE (e.g. Qwen/Qwen2.5-0.5B-Instruct)");
    if (!reference.file.empty()) repo_path(reference.file);
    if (reference.quant.find('/') != std::string::npos || (colon != std::string::npos && end == colon && reference.quant.empty()))
        infer::fail("\"", std::string(text), "\": the quant after ':' is empty or holds a '/' (ORG/NAME:Q4_K_M)");
    return reference;
}

std::string pick_gguf(const std::vector<std::string>& listing, const std::string& quant, const std::string& repo) {
    std::vector<std::string> ggufs;
    for (const std::string& path : listing) {
        const std::string name = lower(fs::path(path).filename().string());
        if (ends_with(name, ".gguf") && name.rfind("mmproj", 0) != 0) ggufs.push_back(path);  // not a vision projector
    }
    std::sort(ggufs.begin(), ggufs.end());
    if (ggufs.empty()) infer::fail(repo, " has no .gguf file (its files: ", some_files(listing), ")");
    // The quant as a word of the name: Q4_K matches model-Q4_K.gguf, not model-Q4_K_M.gguf; Q4_0 not IQ4_0.
    auto matches = [](const std::string& path, const std::string& wanted) {
        const std::string name = lower(fs::path(path).filename().string()), q = lower(wanted);
        for (size_t at = name.find(q); at != std::string::npos; at = name.find(q, at + 1)) {
            const bool before = at == 0 || !std::isalnum(static_cast<unsigned char>(name[at - 1]));
            const char after = at + q.size() < name.size() ? name[at + q.size()] : '.';
            if (before && (after == '.' || after == '-')) return true;
        }
        return false;
    };
    auto first_match = [&](const std::string& wanted) -> std::string {
        for (const std::string& path : ggufs)
            if (matches(path, wanted)) return path;
        return "";
    };
    if (!quant.empty()) {
        std::string found = first_match(quant);
        if (found.empty()) infer::fail("no .gguf file in ", repo, " is quant ", quant, "; on offer: ", some_files(ggufs));
        return found;
    }
    for (const char* preferred : {"Q4_K_M", "Q8_0"})
        if (std::string found = first_match(preferred); !found.empty()) return found;
    return ggufs.front();
}

FilePlan plan_files(const ModelReference& reference, const std::vector<std::string>& listing) {
    FilePlan plan;
    if (!reference.file.empty()) {
        if (!listed(listing, reference.file))
            infer::fail(reference.file, ": not in ", reference.repo, " (its files: ", some_files(listing), ")");
        plan.files = {reference.file};
        plan.model = reference.file;
        // A llama2.c model reads tokenizer.bin beside it by default.
        const std::string tokenizer = (fs::path(reference.file).parent_path() / "tokenizer.bin").generic_string();
        if (ends_with(lower(reference.file), ".bin") && tokenizer != reference.file && listed(listing, tokenizer))
            plan.files.push_back(tokenizer);
        return plan;
    }
    bool any_gguf = false, any_safetensors = false;
    for (const std::string& path : listing) {
        any_gguf |= ends_with(lower(path), ".gguf");
        any_safetensors |= ends_with(path, ".safetensors");
    }
    const bool safetensors_repo = listed(listing, "config.json") && any_safetensors;
    if (!reference.quant.empty() || (!safetensors_repo && any_gguf)) {
        const std::string file = pick_gguf(listing, reference.quant, reference.repo);
        plan.files = {file};
        plan.model = file;
        // A split GGUF (name-00001-of-00003.gguf) comes with its other parts: the same name but for the part number.
        auto split = [](const std::string& path) -> std::optional<std::string> {  // the name without its part number
            const std::string name = lower(path);
            if (name.size() < 21 || !ends_with(name, ".gguf") || name.compare(name.size() - 20, 1, "-") != 0 ||
                name.compare(name.size() - 14, 4, "-of-") != 0)
                return std::nullopt;
            const std::string digits = name.substr(name.size() - 19, 5) + name.substr(name.size() - 10, 5);
            if (!std::all_of(digits.begin(), digits.end(), [](unsigned char c) { return std::isdigit(c); })) return std::nullopt;
            return name.substr(0, name.size() - 19) + name.substr(name.size() - 14);
        };
        if (const std::optional<std::string> whole = split(file))
            for (const std::string& path : listing)
                if (path != file && split(path) == whole) plan.files.push_back(path);
        return plan;
    }
    if (!safetensors_repo)
        infer::fail(reference.repo, " holds neither .gguf files nor config.json with .safetensors weights; name a file ",
                    "with hf:", reference.repo, "/FILE (its files: ", some_files(listing), ")");
    plan.files = {"config.json"};
    if (listed(listing, "model.safetensors.index.json")) {
        plan.index = "model.safetensors.index.json";
        plan.files.push_back(plan.index);
    } else if (listed(listing, "model.safetensors")) {
        plan.files.push_back("model.safetensors");
    } else {
        for (const std::string& path : listing)
            if (ends_with(path, ".safetensors") && path.find('/') == std::string::npos) plan.files.push_back(path);
    }
    for (const char* file : {"tokenizer.json", "tokenizer_config.json", "generation_config.json"})
        if (listed(listing, file)) plan.files.push_back(file);
    return plan;
}

std::vector<std::string> index_shards(const fs::path& index_file) {
    const infer::Json index = infer::Json::parse(infer::read_text_file(index_file), index_file.string());
    std::vector<std::string> shards;
    for (const auto& [tensor, file] : index.at("weight_map").as_object()) {
        if (!file.is_string()) infer::fail(index_file.string(), ": weight_map.", tensor, " is not a file name");
        if (std::find(shards.begin(), shards.end(), file.as_string()) == shards.end()) shards.push_back(file.as_string());
    }
    return shards;
}

fs::path repo_folder(const Settings& settings, const std::string& repo) {
    std::string name = "models--" + repo;
    for (size_t at = name.find('/'); at != std::string::npos; at = name.find('/', at)) name.replace(at, 1, "--");
    return settings.cache / name;
}

fs::path cached_snapshot(const Settings& settings, const ModelReference& reference) {
    const fs::path repo_dir = repo_folder(settings, reference.repo);
    std::string commit;
    if (is_hex(reference.revision, 40)) {
        commit = reference.revision;
    } else {
        std::ifstream ref(repo_dir / "refs" / reference.revision);
        std::getline(ref, commit);
        while (!commit.empty() && std::isspace(static_cast<unsigned char>(commit.back()))) commit.pop_back();
    }
    if (commit.empty() || commit.find('/') != std::string::npos || commit == "." || commit == "..") return {};
    const fs::path snapshot = repo_dir / "snapshots" / commit;
    return fs::is_directory(snapshot) ? snapshot : fs::path();
}

fs::path pull(const ModelReference& reference, const Settings& settings) {
    if (settings.offline) return pull_from_cache(reference, settings, "HF_HUB_OFFLINE is set and ");
    try {
        return pull_online(reference, settings);
    } catch (const Unreachable& unreachable) {
        // No network: what the cache holds still runs, with a word saying it may not be the latest.
        try {
            fs::path cached = pull_from_cache(reference, settings, "");
            std::cerr << "note: " << unreachable.what() << "\nnote: using the copy of " << reference.text()
                      << " in the hub cache: " << cached.string() << '\n';
            return cached;
        } catch (const infer::Error&) {
            infer::fail(unreachable.what(), ", and the hub cache (", settings.cache.string(), ") holds no copy of ",
                        reference.text(), " to use instead");
        }
    }
}

std::vector<std::string> resolve_model_arguments(std::vector<std::string> args, const Settings& settings) {
    std::string repo, file, command = args.size() > 1 ? args[1] : "";
    bool has_model = false, has_name = false;
    std::vector<std::string> out;
    std::string served_name;
    for (size_t i = 0; i < args.size(); ++i) {
        const std::string& arg = args[i];
        const bool last = i + 1 >= args.size();
        if (i >= 2 && (arg == "-hf" || arg == "-hfr" || arg == "--hf-repo")) {
            if (last) infer::fail("option ", arg, " needs a value: ORG/NAME[:QUANT]");
            repo = args[++i];
            continue;
        }
        if (i >= 2 && (arg == "-hff" || arg == "--hf-file")) {
            if (last) infer::fail("option ", arg, " needs a value: a file in the repository of -hf");
            file = args[++i];
            continue;
        }
        if (i >= 2 && arg == "--served-model-name") has_name = true;
        out.push_back(arg);
        if (i >= 2 && (arg == "-m" || arg == "--model") && !last) {
            has_model = true;
            std::string value = args[++i];
            if (value.rfind("hf:", 0) == 0) {
                const ModelReference reference = parse_reference(value);
                served_name = reference.repo;
                value = pull(reference, settings).string();
            }
            out.push_back(value);
        }
    }
    if (!file.empty() && repo.empty()) infer::fail("option -hff ", file, " names a file in the repository of -hf ORG/NAME: give -hf too");
    if (!repo.empty()) {
        if (has_model) infer::fail("give the model with -m or with -hf, not both");
        ModelReference reference = parse_reference(repo);
        if (!file.empty()) {
            if (!reference.quant.empty()) infer::fail("give -hf ", repo, " a quant or -hff a file, not both");
            reference.file = repo_path(file);
        }
        served_name = reference.repo;
        out.push_back("-m");
        out.push_back(pull(reference, settings).string());
    }
    // infer serve names the model after its file; a snapshot folder is named by a commit, so say the repository.
    if (command == "serve" && !served_name.empty() && !has_name) {
        out.push_back("--served-model-name");
        out.push_back(served_name);
    }
    return out;
}

int run_pull(int argc, char** argv) {
    std::string name, file;
    for (int i = 2; i < argc; ++i) {
        const std::string arg = argv[i];
        if (arg == "-h" || arg == "--help") {
            std::cout << usage_text;
            return 0;
        }
        if ((arg == "-hff" || arg == "--hf-file") && i + 1 < argc) {
            file = argv[++i];
        } else if (!arg.empty() && arg[0] == '-') {
            infer::fail("unknown option \"", arg, "\"\n", usage_text);
        } else if (name.empty()) {
            name = arg;
        } else {
            infer::fail("infer pull takes one model name, not \"", name, "\" and \"", arg, "\"");
        }
    }
    if (name.empty()) infer::fail("infer pull needs a model name\n", usage_text);
    ModelReference reference = parse_reference(name);
    if (!file.empty()) reference.file = repo_path(file);
    const fs::path path = pull(reference, Settings::from_environment());
    std::cout << path.string() << '\n';
    return 0;
}

// ---- SHA-256 (FIPS 180-4) -----------------------------------------------------------------------------------------

namespace {
constexpr uint32_t sha_k[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5, 0xd807aa98, 0x12835b01,
    0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174, 0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc,
    0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da, 0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147,
    0x06ca6351, 0x14292967, 0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070, 0x19a4c116, 0x1e376c08,
    0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3, 0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208,
    0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};
constexpr uint32_t rotr(uint32_t x, int n) { return (x >> n) | (x << (32 - n)); }
}  // namespace

Sha256::Sha256()
    : state_{0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19}, buffer_{} {}

void Sha256::block(const unsigned char* data) {
    uint32_t w[64];
    for (int i = 0; i < 16; ++i)
        w[i] = uint32_t{data[4 * i]} << 24 | uint32_t{data[4 * i + 1]} << 16 | uint32_t{data[4 * i + 2]} << 8 | data[4 * i + 3];
    for (int i = 16; i < 64; ++i) {
        const uint32_t s0 = rotr(w[i - 15], 7) ^ rotr(w[i - 15], 18) ^ (w[i - 15] >> 3);
        const uint32_t s1 = rotr(w[i - 2], 17) ^ rotr(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = state_[0], b = state_[1], c = state_[2], d = state_[3], e = state_[4], f = state_[5], g = state_[6], h = state_[7];
    for (int i = 0; i < 64; ++i) {
        const uint32_t t1 = h + (rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25)) + ((e & f) ^ (~e & g)) + sha_k[i] + w[i];
        const uint32_t t2 = (rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        h = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    state_[0] += a, state_[1] += b, state_[2] += c, state_[3] += d, state_[4] += e, state_[5] += f, state_[6] += g, state_[7] += h;
}

void Sha256::update(const void* data, size_t size) {
    const auto* bytes = static_cast<const unsigned char*>(data);
    length_ += size;
    if (buffered_ > 0) {
        const size_t take = std::min(size, 64 - buffered_);
        std::memcpy(buffer_ + buffered_, bytes, take);
        buffered_ += take, bytes += take, size -= take;
        if (buffered_ < 64) return;
        block(buffer_);
        buffered_ = 0;
    }
    for (; size >= 64; bytes += 64, size -= 64) block(bytes);
    std::memcpy(buffer_, bytes, size);
    buffered_ = size;
}

std::string Sha256::hex() {
    const uint64_t bits = length_ * 8;
    const unsigned char pad = 0x80;
    update(&pad, 1);
    const unsigned char zero = 0;
    while (buffered_ != 56) update(&zero, 1);
    unsigned char length[8];
    for (int i = 0; i < 8; ++i) length[i] = static_cast<unsigned char>(bits >> (56 - 8 * i));
    update(length, 8);
    static const char digits[] = "0123456789abcdef";
    std::string out;
    for (uint32_t word : state_)
        for (int shift = 28; shift >= 0; shift -= 4) out += digits[(word >> shift) & 15];
    return out;
}

std::string sha256_hex(std::string_view bytes) {
    Sha256 hash;
    hash.update(bytes.data(), bytes.size());
    return hash.hex();
}

std::string sha256_file(const fs::path& path) {
    std::ifstream in(path, std::ios::binary);
    if (!in) infer::fail(path.string(), ": cannot open");
    Sha256 hash;
    std::vector<char> buffer(1 << 20);
    while (in.read(buffer.data(), static_cast<std::streamsize>(buffer.size())) || in.gcount() > 0)
        hash.update(buffer.data(), static_cast<size_t>(in.gcount()));
    return hash.hex();
}

}  // namespace hub
