/* LD_PRELOAD shim for wrk (which has no client-certificate option): every SSL_CTX wrk
 * creates gets the certificate and key named by BENCH_CLIENT_CERT and BENCH_CLIENT_KEY
 * before its first connection. wrk reuses one SSL per connection slot across reconnects
 * (SSL_clear), which keeps the TLS session, so every reconnect would resume it; the
 * SSL_clear below drops the session, so each new connection makes a full handshake with
 * client-certificate verification, as client-go does (it keeps no session cache).
 * BENCH_TLS_RESUME=1 keeps the session (the bench's servers offer no resumption, so
 * only a server configured for it would resume). Written for mvproxy's bench; built by
 * bench/run.py. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdlib.h>

typedef struct ssl_st SSL;
typedef struct ssl_ctx_st SSL_CTX;

static SSL_CTX *loaded;

SSL *SSL_new(SSL_CTX *ctx) {
    static SSL *(*real_new)(SSL_CTX *);
    static int (*use_chain)(SSL_CTX *, const char *);
    static int (*use_key)(SSL_CTX *, const char *, int);
    if (!real_new) {
        real_new = (SSL *(*)(SSL_CTX *))dlsym(RTLD_NEXT, "SSL_new");
        use_chain = (int (*)(SSL_CTX *, const char *))dlsym(RTLD_DEFAULT,
                                                            "SSL_CTX_use_certificate_chain_file");
        use_key = (int (*)(SSL_CTX *, const char *, int))dlsym(RTLD_DEFAULT,
                                                              "SSL_CTX_use_PrivateKey_file");
    }
    const char *cert = getenv("BENCH_CLIENT_CERT"), *key = getenv("BENCH_CLIENT_KEY");
    if (ctx != loaded && cert && key && use_chain && use_key) {
        if (use_chain(ctx, cert) != 1 || use_key(ctx, key, 1 /* PEM */) != 1)
            abort();  /* a silent fallback would measure something else */
        loaded = ctx;
    }
    return real_new(ctx);
}

int SSL_clear(SSL *ssl) {
    static int (*real_clear)(SSL *);
    static int (*set_session)(SSL *, void *);
    if (!real_clear) {
        real_clear = (int (*)(SSL *))dlsym(RTLD_NEXT, "SSL_clear");
        set_session = (int (*)(SSL *, void *))dlsym(RTLD_DEFAULT, "SSL_set_session");
    }
    int done = real_clear(ssl);
    const char *resume = getenv("BENCH_TLS_RESUME");
    if (done == 1 && set_session && !(resume && resume[0] == '1'))
        set_session(ssl, NULL);
    return done;
}
