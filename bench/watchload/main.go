// Command watchload holds many Kubernetes-style watches open through a proxy, with the
// standard library's HTTP client (HTTP/2 over TLS by default, as client-go), so the
// proxy's memory per watch and per connection can be read while they stay open.
//
//	watchload server -listen 127.0.0.1:PORT -cert C -key K [-interval 30s]
//	watchload client -url https://127.0.0.1:PORT -ca CA (-cert C -key K | -token T)
//	                 [-h1] [-idle N] [-steps 1000,5000,10000]
//
// server: a TLS backend (HTTP/2 and HTTP/1.1, 100 streams per connection as
// kube-apiserver) that answers GET ...?watch=true with a chunked JSON event stream that
// stays open, one event every -interval; /api and /apis with empty aggregated discovery
// documents (what mvproxy's poller reads); anything else with a small ConfigMap.
//
// client: first -idle connections that each make one GET and stay open (a transport
// each, so each is its own connection), then watches up to each count in -steps. After
// each phase it prints one JSON line (phase, watches, connections dialled, events read,
// errors) and waits for a line on stdin before the next; after the last it holds
// everything until stdin closes. Connections are counted where they are dialled.
package main

import (
	"bufio"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: watchload server|client [flags]")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "server":
		server(os.Args[2:])
	case "client":
		client(os.Args[2:])
	default:
		fmt.Fprintf(os.Stderr, "watchload: unknown mode %q\n", os.Args[1])
		os.Exit(2)
	}
}

const discovery = `{"kind":"APIGroupDiscoveryList","apiVersion":"apidiscovery.k8s.io/v2","metadata":{},"items":[]}`
const aggregated = "application/json;g=apidiscovery.k8s.io;v=v2;as=APIGroupDiscoveryList"

func configMap() []byte {
	return []byte(`{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"bench","namespace":"default",` +
		`"uid":"6f2c1b9e-3c1d-4a8e-9d1e-1f2b3c4d5e6f","resourceVersion":"1",` +
		`"creationTimestamp":"2026-01-01T00:00:00Z"},"data":{"k":"` + strings.Repeat("v", 250) + `"}}`)
}

func server(args []string) {
	fs := flag.NewFlagSet("server", flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:0", "address to listen on (loopback)")
	cert := fs.String("cert", "", "server certificate")
	key := fs.String("key", "", "server key")
	interval := fs.Duration("interval", 30*time.Second, "time between a watch's events")
	_ = fs.Parse(args)
	body := configMap()
	var open atomic.Int64
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		switch {
		case r.URL.Query().Get("watch") == "true":
			watch(w, r, *interval, &open)
		case r.URL.Path == "/api" || r.URL.Path == "/apis":
			w.Header().Set("Content-Type", aggregated)
			_, _ = io.WriteString(w, discovery)
		default:
			w.Header().Set("Content-Type", "application/json")
			_, _ = w.Write(body)
		}
	})
	srv := &http.Server{
		Addr:              *listen,
		Handler:           mux,
		ReadHeaderTimeout: 30 * time.Second,
		TLSConfig:         &tls.Config{ClientAuth: tls.RequestClientCert, MinVersion: tls.VersionTLS12},
		HTTP2:             &http.HTTP2Config{MaxConcurrentStreams: 100},
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		fatal(err)
	}
	fmt.Printf("{\"listening\":%q}\n", ln.Addr().String())
	fatal(srv.ServeTLS(ln, *cert, *key))
}

// watch streams one ADDED event, then a MODIFIED every interval, until the client leaves.
func watch(w http.ResponseWriter, r *http.Request, interval time.Duration, open *atomic.Int64) {
	open.Add(1)
	defer open.Add(-1)
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(http.StatusOK)
	flusher, _ := w.(http.Flusher)
	event := func(kind string, rv int) bool {
		line := fmt.Sprintf(`{"type":%q,"object":{"kind":"ConfigMap","apiVersion":"v1",`+
			`"metadata":{"name":"bench","namespace":"default","resourceVersion":"%d"}}}`+"\n", kind, rv)
		if _, err := io.WriteString(w, line); err != nil {
			return false
		}
		if flusher != nil {
			flusher.Flush()
		}
		return true
	}
	if !event("ADDED", 1) {
		return
	}
	ticker := time.NewTicker(interval)
	defer ticker.Stop()
	for rv := 2; ; rv++ {
		select {
		case <-r.Context().Done():
			return
		case <-ticker.C:
			if !event("MODIFIED", rv) {
				return
			}
		}
	}
}

type counters struct {
	dialled atomic.Int64
	closed  atomic.Int64
	events  atomic.Int64
	errors  atomic.Int64
	ended   atomic.Int64
	lastErr atomic.Value
}

func (c *counters) fail(err error) {
	c.errors.Add(1)
	c.lastErr.Store(err.Error())
}

func client(args []string) {
	fs := flag.NewFlagSet("client", flag.ExitOnError)
	base := fs.String("url", "", "the proxy's https URL")
	caFile := fs.String("ca", "", "CA of the proxy's serving certificate")
	cert := fs.String("cert", "", "client certificate (mTLS)")
	key := fs.String("key", "", "client key (mTLS)")
	token := fs.String("token", "", "bearer token instead of a client certificate")
	h1 := fs.Bool("h1", false, "HTTP/1.1 only: every concurrent request its own connection")
	idle := fs.Int("idle", 0, "idle connections first, one GET each")
	steps := fs.String("steps", "1000", "watch counts to reach, comma-separated, rising")
	parallel := fs.Int("parallel", 64, "watches being opened at once")
	path := fs.String("path", "/api/v1/namespaces/default/configmaps", "what to watch")
	_ = fs.Parse(args)

	var c counters
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tlsConfig := tlsFor(*caFile, *cert, *key)
	newTransport := func() *http.Transport {
		dialer := &net.Dialer{Timeout: 30 * time.Second, KeepAlive: 30 * time.Second}
		t := &http.Transport{
			TLSClientConfig:     tlsConfig.Clone(),
			ForceAttemptHTTP2:   !*h1,
			MaxIdleConnsPerHost: 100000,
			IdleConnTimeout:     time.Hour,
			TLSHandshakeTimeout: 30 * time.Second,
			DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
				conn, err := dialer.DialContext(ctx, network, addr)
				if err != nil {
					return nil, err
				}
				c.dialled.Add(1)
				return &countedConn{Conn: conn, c: &c}, nil
			},
		}
		if *h1 {
			// a non-nil empty map turns HTTP/2 off, as GODEBUG=http2client=0 would
			t.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
		} else {
			// client-go's HTTP/2 health check: PING after 30 s without a frame
			t.HTTP2 = &http.HTTP2Config{SendPingTimeout: 30 * time.Second, PingTimeout: 15 * time.Second}
		}
		return t
	}
	request := func(target string) *http.Request {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, target, nil)
		if err != nil {
			fatal(err)
		}
		req.Header.Set("Accept", "application/json")
		if *token != "" {
			req.Header.Set("Authorization", "Bearer "+*token)
		}
		return req
	}
	report := func(phase string, watches int, started time.Time) {
		line := map[string]any{"phase": phase, "watches": watches,
			"connections": c.dialled.Load() - c.closed.Load(), "dialled": c.dialled.Load(),
			"events": c.events.Load(), "errors": c.errors.Load(), "ended": c.ended.Load(),
			"seconds": time.Since(started).Seconds()}
		if msg, ok := c.lastErr.Load().(string); ok {
			line["last_error"] = msg
		}
		out, _ := json.Marshal(line)
		fmt.Println(string(out))
	}
	stdin := bufio.NewScanner(os.Stdin)
	next := func() bool { return stdin.Scan() }

	// idle connections: a transport each, so each GET dials its own
	started := time.Now()
	var keep []*http.Transport
	for i := 0; i < *idle; i++ {
		t := newTransport()
		keep = append(keep, t)
		resp, err := (&http.Client{Transport: t, Timeout: 30 * time.Second}).Do(request(*base + *path + "/bench"))
		if err != nil {
			c.fail(err)
			continue
		}
		_, _ = io.Copy(io.Discard, resp.Body)
		_ = resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			c.fail(fmt.Errorf("idle GET: %s", resp.Status))
		}
	}
	report("idle", 0, started)
	if !next() {
		return
	}
	idleOpen := c.dialled.Load() - c.closed.Load()

	// watches, all on one transport as one client-go program's informers
	shared := newTransport()
	watchURL := *base + *path + "?watch=true&allowWatchBookmarks=true&timeoutSeconds=3600"
	open := 0
	var firstEvents sync.WaitGroup
	sem := make(chan struct{}, *parallel)
	for _, field := range strings.Split(*steps, ",") {
		target, err := strconv.Atoi(strings.TrimSpace(field))
		if err != nil {
			fatal(err)
		}
		started = time.Now()
		for ; open < target; open++ {
			sem <- struct{}{}
			firstEvents.Add(1)
			go holdWatch(shared, request(watchURL), &c, func() { <-sem; firstEvents.Done() })
		}
		firstEvents.Wait()
		line := map[string]any{"phase": "watches", "watches": open,
			"connections": c.dialled.Load() - c.closed.Load() - idleOpen, "idle_connections": idleOpen,
			"dialled": c.dialled.Load(),
			"events":  c.events.Load(), "errors": c.errors.Load(), "ended": c.ended.Load(),
			"seconds": time.Since(started).Seconds()}
		if msg, ok := c.lastErr.Load().(string); ok {
			line["last_error"] = msg
		}
		out, _ := json.Marshal(line)
		fmt.Println(string(out))
		if !next() {
			return
		}
	}
	for next() {
		report("hold", open, started)
	}
	for _, t := range keep {
		t.CloseIdleConnections()
	}
}

// holdWatch opens one watch, calls opened once its first event (or its failure) is in,
// then counts events until the stream ends.
func holdWatch(t *http.Transport, req *http.Request, c *counters, opened func()) {
	once := sync.OnceFunc(opened)
	defer once()
	resp, err := t.RoundTrip(req)
	if err != nil {
		c.fail(err)
		return
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		c.fail(fmt.Errorf("watch: %s", resp.Status))
		return
	}
	lines := bufio.NewScanner(resp.Body)
	lines.Buffer(make([]byte, 4096), 1<<20)
	for lines.Scan() {
		c.events.Add(1)
		once()
	}
	if err := lines.Err(); err != nil && req.Context().Err() == nil {
		c.fail(err)
	}
	c.ended.Add(1)
}

// countedConn counts its own closing: Go's HTTP/2 pool closes a connection dialled
// while another became usable, so connections open = dialled - closed.
type countedConn struct {
	net.Conn
	c    *counters
	once sync.Once
}

func (cc *countedConn) Close() error {
	cc.once.Do(func() { cc.c.closed.Add(1) })
	return cc.Conn.Close()
}

func tlsFor(caFile, cert, key string) *tls.Config {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		fatal(err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		fatal(fmt.Errorf("no certificate in %s", caFile))
	}
	config := &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
	if cert != "" {
		pair, err := tls.LoadX509KeyPair(cert, key)
		if err != nil {
			fatal(err)
		}
		config.Certificates = []tls.Certificate{pair}
	}
	return config
}

func fatal(err error) {
	fmt.Fprintln(os.Stderr, "watchload:", err)
	os.Exit(1)
}
