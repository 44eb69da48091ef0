// http_listen.hpp — binds a cpp-httplib server with a listen backlog sized for bursts of clients.
//
// cpp-httplib listens with a backlog of 5 (a constant of the library as Debian builds it): a burst of 200 clients
// overflows it and the kernel resets connections before the server has seen them, so they get neither an answer nor
// a 429. Calling listen() again on the bound socket raises the bound (Linux caps it at net.core.somaxconn); the
// connections then wait in the kernel until a worker thread takes them and the admission check answers them.
#pragma once

#include "infer.hpp"

#include <httplib.h>
#include <sys/socket.h>

#include <memory>
#include <string>

namespace serve {

inline void bind_with_backlog(httplib::Server& http, const std::string& host, int port, int backlog, const char* program) {
    auto listening = std::make_shared<socket_t>(-1);
    http.set_socket_options([listening](socket_t socket) {  // the socket httplib binds: remembered for listen()
        httplib::default_socket_options(socket);
        *listening = socket;
    });
    if (!http.bind_to_port(host.c_str(), port)) infer::fail(program, ": cannot listen on ", host, ":", port);
    if (*listening < 0 || ::listen(*listening, backlog) != 0)
        infer::fail(program, ": cannot set the listen backlog to ", backlog, " (--backlog)");
}

}  // namespace serve
