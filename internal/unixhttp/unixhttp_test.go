package unixhttp

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// serve runs h on a unix socket (net/http, as mgpu's servers) until the
// test ends and returns the socket's path.
func serve(t *testing.T, h http.Handler) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "uh")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	sock := filepath.Join(dir, "s.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(l) }()
	t.Cleanup(func() { _ = srv.Close() })
	return sock
}

func TestDoAgainstNetHTTP(t *testing.T) {
	t.Parallel()
	mux := http.NewServeMux()
	mux.HandleFunc("POST /echo", func(w http.ResponseWriter, r *http.Request) {
		if r.Header.Get("Content-Type") != "application/json" {
			http.Error(w, "no json", http.StatusUnsupportedMediaType)
			return
		}
		b, _ := io.ReadAll(r.Body)
		w.WriteHeader(http.StatusCreated)
		_, _ = w.Write(b)
	})
	mux.HandleFunc("GET /query", func(w http.ResponseWriter, r *http.Request) {
		_, _ = io.WriteString(w, r.URL.Query().Get("a")+"|"+r.URL.Query().Get("b"))
	})
	// An answer streamed in pieces of unknown total length: net/http
	// neither chunks it nor keeps the connection, for an HTTP/1.0 request.
	mux.HandleFunc("GET /big", func(w http.ResponseWriter, _ *http.Request) {
		for i := 0; i < 100; i++ {
			_, _ = io.WriteString(w, strings.Repeat("x", 1000))
			w.(http.Flusher).Flush()
		}
	})
	sock := serve(t, mux)
	ctx := context.Background()

	r, err := Do(ctx, sock, "POST", "/echo", []byte(`{"a":1}`), 1<<20)
	if err != nil || r.StatusCode != 201 || r.Status != "201 Created" || string(r.Body) != `{"a":1}` {
		t.Fatalf("POST: %+v %v", r, err)
	}
	r, err = Do(ctx, sock, "GET", "/query?a=x%20y&b=%26", nil, 1<<20)
	if err != nil || r.StatusCode != 200 || string(r.Body) != "x y|&" {
		t.Fatalf("GET query: %+v %v", r, err)
	}
	r, err = Do(ctx, sock, "GET", "/nothing", nil, 1<<20)
	if err != nil || r.StatusCode != 404 || r.Status != "404 Not Found" {
		t.Fatalf("404: %+v %v", r, err)
	}
	r, err = Do(ctx, sock, "GET", "/big", nil, 1<<20)
	if err != nil || len(r.Body) != 100000 {
		t.Fatalf("streamed: %d bytes, %v", len(r.Body), err)
	}
	if _, err = Do(ctx, sock, "GET", "/big", nil, 99999); !errors.Is(err, ErrProtocol) {
		t.Fatalf("streamed over the limit: %v", err)
	}
	if _, err = Do(ctx, sock, "POST", "/echo", make([]byte, 2000), 1000); !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), "more than 1000") {
		t.Fatalf("Content-Length over the limit: %v", err)
	}
}

func TestDoErrors(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	dir := t.TempDir()
	if _, err := Do(ctx, filepath.Join(dir, "none.sock"), "GET", "/", nil, 10); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("no socket: %v", err)
	}
	for _, tc := range []struct{ method, target string }{{"get", "/"}, {"", "/"}, {"GET", "x"}, {"GET", "/a b"}, {"GET", "/a\r\nX: y"}} {
		if _, err := Do(ctx, filepath.Join(dir, "none.sock"), tc.method, tc.target, nil, 10); err == nil || !strings.Contains(err.Error(), "unixhttp: bad") {
			t.Errorf("%q %q: %v", tc.method, tc.target, err)
		}
	}
	// A server that never answers: the context ends the exchange.
	hang := make(chan struct{})
	t.Cleanup(func() { close(hang) })
	sock := serve(t, http.HandlerFunc(func(http.ResponseWriter, *http.Request) { <-hang }))
	cctx, cancel := context.WithTimeout(ctx, 100*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := Do(cctx, sock, "GET", "/", nil, 10); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("hung server: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("gave up after %s", d)
	}
	cctx, cancel = context.WithCancel(ctx)
	time.AfterFunc(50*time.Millisecond, cancel)
	if _, err := Do(cctx, sock, "GET", "/", nil, 10); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled: %v", err)
	}
}

func TestReadResponse(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct{ name, in, want string }{
		{"no status", "", "status line"},
		{"http2", "HTTP/2 200 OK\r\n\r\n", "status line"},
		{"short code", "HTTP/1.1 20 OK\r\n\r\n", "status line"},
		{"letters", "HTTP/1.1 2x0 OK\r\n\r\n", "status line"},
		{"header without colon", "HTTP/1.1 200 OK\r\nX\r\n\r\n", "header line"},
		{"negative length", "HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", "Content-Length"},
		{"two lengths", "HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", "Content-Length"},
		{"chunked", "HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n0\r\n\r\n", "Transfer-Encoding"},
		{"short body", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab", "body"},
		{"no end of head", "HTTP/1.1 200 OK\r\nContent-Length: 5\r\n", "header"},
		{"long line", "HTTP/1.1 200 OK\r\nX: " + strings.Repeat("a", 9000) + "\r\n\r\n", "longer than"},
		{"many headers", "HTTP/1.1 200 OK\r\n" + strings.Repeat("X: y\r\n", 100) + "\r\n", "header lines"},
	} {
		_, err := ReadResponse(bufio.NewReader(strings.NewReader(tc.in)), 100)
		if !errors.Is(err, ErrProtocol) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}
	r, err := ReadResponse(bufio.NewReader(strings.NewReader("HTTP/1.0 200 OK\nContent-Length: 2\n\nab")), 100)
	if err != nil || string(r.Body) != "ab" || r.StatusCode != 200 {
		t.Fatalf("LF lines: %+v %v", r, err)
	}
}

// FuzzReadResponse: the reader never panics and never returns more body
// than allowed.
func FuzzReadResponse(f *testing.F) {
	f.Add("HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nab")
	f.Add("HTTP/1.0 404 Not Found\r\n\r\nnope")
	f.Add("HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
	f.Fuzz(func(t *testing.T, in string) {
		r, err := ReadResponse(bufio.NewReader(strings.NewReader(in)), 64)
		if err != nil {
			if !errors.Is(err, ErrProtocol) {
				t.Fatalf("error not ErrProtocol: %v", err)
			}
			return
		}
		if len(r.Body) > 64 || r.StatusCode < 100 || r.StatusCode > 999 {
			t.Fatalf("accepted %+v", r)
		}
	})
}
