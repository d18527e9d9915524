// Package unixhttp asks mgpu's own JSON APIs on local unix sockets (the
// enforcers' control sockets, the node agent's socket) one question per
// connection, without net/http.
//
// Why not net/http: mgpu-hook runs on every container start, and the
// runtime waits for it. Importing net/http (with crypto/tls, x509, http2 and
// their package initialisers) doubles the size of the binary and adds
// milliseconds to every start before main runs. These APIs need none of it:
// the servers are mgpu's own net/http servers on a local socket, a request is
// a method, a path and at most one small JSON body, and an answer is a status
// and a bounded body. So a request is written as HTTP/1.0 (the server then
// neither keeps the connection nor chunks the answer) and the answer is read
// up to Content-Length or the end of the connection, with every part bounded.
package unixhttp

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"strconv"
	"strings"
	"time"
)

// Response is a server's answer.
type Response struct {
	// StatusCode is the three-digit status, e.g. 404.
	StatusCode int
	// Status is the code and its reason phrase, e.g. "404 Not Found".
	Status string
	// Body is the whole body (at most the limit given to Do).
	Body []byte
}

// Limits of what is read of an answer's head.
const (
	maxStatusLine = 1 << 10
	maxHeaderLine = 8 << 10
	maxHeaders    = 64
)

// ErrProtocol wraps an answer that is not a well-formed, bounded HTTP/1.x
// response. An error of the connection itself is returned as it is.
var ErrProtocol = errors.New("malformed answer")

// Do sends method target (a path with an optional query) with body (nil for
// none; sent as application/json) to the server on socket, and returns its
// answer, whose body may be at most maxBody bytes. ctx bounds the whole
// exchange. A dial error is returned as net.Dial's (errors.Is finds
// syscall.ENOENT, ECONNREFUSED).
func Do(ctx context.Context, socket, method, target string, body []byte, maxBody int64) (*Response, error) {
	if !token(method) {
		return nil, fmt.Errorf("unixhttp: bad method %q", method)
	}
	if !strings.HasPrefix(target, "/") || strings.ContainsAny(target, " \t\r\n") {
		return nil, fmt.Errorf("unixhttp: bad request target %q", target)
	}
	var d net.Dialer
	conn, err := d.DialContext(ctx, "unix", socket)
	if err != nil {
		return nil, err
	}
	defer func() { _ = conn.Close() }()
	// The end of ctx (its deadline or a cancel) ends a blocked read or
	// write at once, and ctxErr then reports ctx's error.
	stop := context.AfterFunc(ctx, func() { _ = conn.SetDeadline(time.Unix(1, 0)) })
	defer stop()

	var req bytes.Buffer
	req.Grow(128 + len(body))
	req.WriteString(method + " " + target + " HTTP/1.0\r\nHost: localhost\r\n")
	if body != nil {
		req.WriteString("Content-Type: application/json\r\nContent-Length: " + strconv.Itoa(len(body)) + "\r\n")
	}
	req.WriteString("\r\n")
	req.Write(body)
	if _, err := conn.Write(req.Bytes()); err != nil {
		return nil, ctxErr(ctx, err)
	}
	resp, err := ReadResponse(bufio.NewReaderSize(conn, 4096), maxBody)
	if err != nil {
		return nil, ctxErr(ctx, err)
	}
	return resp, nil
}

// ctxErr prefers ctx's error when it ended the exchange.
func ctxErr(ctx context.Context, err error) error {
	if ctx.Err() != nil {
		return fmt.Errorf("%w (%w)", ctx.Err(), err)
	}
	return err
}

// ReadResponse reads one HTTP/1.x answer whose connection ends with it: the
// status line, the header (only Content-Length and Transfer-Encoding are
// looked at) and the body, up to Content-Length or the end of r, at most
// maxBody bytes.
func ReadResponse(r *bufio.Reader, maxBody int64) (*Response, error) {
	line, err := readLine(r, maxStatusLine)
	if err != nil {
		return nil, fmt.Errorf("status line: %w", err)
	}
	proto, status, _ := strings.Cut(line, " ")
	if proto != "HTTP/1.0" && proto != "HTTP/1.1" {
		return nil, fmt.Errorf("%w: status line %q", ErrProtocol, line)
	}
	codeStr, _, _ := strings.Cut(status, " ")
	code, err := strconv.Atoi(codeStr)
	if err != nil || len(codeStr) != 3 || code < 100 {
		return nil, fmt.Errorf("%w: status line %q", ErrProtocol, line)
	}
	length := int64(-1)
	for n := 0; ; n++ {
		if n > maxHeaders {
			return nil, fmt.Errorf("%w: more than %d header lines", ErrProtocol, maxHeaders)
		}
		h, err := readLine(r, maxHeaderLine)
		if err != nil {
			return nil, fmt.Errorf("header: %w", err)
		}
		if h == "" {
			break
		}
		k, v, ok := strings.Cut(h, ":")
		if !ok {
			return nil, fmt.Errorf("%w: header line %q", ErrProtocol, h)
		}
		v = strings.TrimSpace(v)
		switch {
		case strings.EqualFold(k, "Content-Length"):
			l, err := strconv.ParseInt(v, 10, 64)
			if err != nil || l < 0 || (length >= 0 && l != length) {
				return nil, fmt.Errorf("%w: Content-Length %q", ErrProtocol, v)
			}
			length = l
		case strings.EqualFold(k, "Transfer-Encoding") && !strings.EqualFold(v, "identity"):
			return nil, fmt.Errorf("%w: Transfer-Encoding %q to an HTTP/1.0 request", ErrProtocol, v)
		}
	}
	if length > maxBody {
		return nil, fmt.Errorf("%w: body of %d bytes, more than %d", ErrProtocol, length, maxBody)
	}
	var body []byte
	if length >= 0 {
		body = make([]byte, length)
		if _, err := io.ReadFull(r, body); err != nil {
			return nil, fmt.Errorf("body: %w", eofIsProtocol(err))
		}
	} else {
		body, err = io.ReadAll(io.LimitReader(r, maxBody+1))
		if err != nil {
			return nil, fmt.Errorf("body: %w", err)
		}
		if int64(len(body)) > maxBody {
			return nil, fmt.Errorf("%w: body of more than %d bytes", ErrProtocol, maxBody)
		}
	}
	return &Response{StatusCode: code, Status: status, Body: body}, nil
}

// readLine reads one CRLF- (or LF-) terminated line of at most max bytes.
// A line cut short by the end of r, or too long, is ErrProtocol.
func readLine(r *bufio.Reader, max int) (string, error) {
	var line []byte
	for {
		frag, err := r.ReadSlice('\n')
		line = append(line, frag...)
		if len(line) > max {
			return "", fmt.Errorf("%w: line longer than %d bytes", ErrProtocol, max)
		}
		if err == nil {
			break
		}
		if !errors.Is(err, bufio.ErrBufferFull) {
			return "", eofIsProtocol(err)
		}
	}
	line = bytes.TrimSuffix(bytes.TrimSuffix(line, []byte("\n")), []byte("\r"))
	return string(line), nil
}

// eofIsProtocol makes an answer that ends too soon an ErrProtocol.
func eofIsProtocol(err error) error {
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("%w: the answer ends too soon", ErrProtocol)
	}
	return err
}

// token reports whether s is an HTTP method: upper-case letters only.
func token(s string) bool {
	if s == "" {
		return false
	}
	for i := 0; i < len(s); i++ {
		if s[i] < 'A' || s[i] > 'Z' {
			return false
		}
	}
	return true
}
