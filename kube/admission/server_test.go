package admission

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// writeCerts generates certificates for 127.0.0.1, writes them into dir
// with modification time mod, and returns them.
func writeCerts(t *testing.T, dir string, mod time.Time) *Certs {
	t.Helper()
	c, err := GenerateCerts(CertOptions{IPs: []net.IP{net.ParseIP("127.0.0.1")}})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Write(dir, true); err != nil {
		t.Fatal(err)
	}
	touch(t, dir, mod)
	return c
}

func touch(t *testing.T, dir string, mod time.Time) {
	t.Helper()
	for _, f := range []string{CertFile, KeyFile} {
		if err := os.Chtimes(filepath.Join(dir, f), mod, mod); err != nil {
			t.Fatal(err)
		}
	}
}

// served returns the leaf certificate the server at addr presents.
func served(t *testing.T, addr string, roots *x509.CertPool) []byte {
	t.Helper()
	conn, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12})
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	return conn.ConnectionState().PeerCertificates[0].Raw
}

func TestServe(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	base := time.Now().Add(-time.Hour)
	first := writeCerts(t, dir, base)
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(first.CA)

	log, logs := testLogger()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- Serve(ctx, l, filepath.Join(dir, CertFile), filepath.Join(dir, KeyFile), log, nil) }()

	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig: &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS12},
	}}
	resp, err := client.Get("https://" + addr + HealthPath)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "ok\n" {
		t.Fatalf("%s %q", resp.Status, body)
	}
	resp, err = client.Post("https://"+addr+MutatePath, "application/json", strings.NewReader(reviewJSON("u-9", "CREATE", "", "Pod", sharePod)))
	if err != nil {
		t.Fatal(err)
	}
	body, _ = io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"uid":"u-9"`) {
		t.Fatalf("%s %s", resp.Status, body)
	}

	// TLS 1.1 is refused.
	if c, err := tls.Dial("tcp", addr, &tls.Config{RootCAs: roots, MinVersion: tls.VersionTLS10, MaxVersion: tls.VersionTLS11}); err == nil {
		c.Close()
		t.Error("a TLS 1.1 handshake succeeded")
	}

	if got := served(t, addr, roots); !bytes.Equal(got, parseCert(t, first.Cert).Raw) {
		t.Error("not the first certificate")
	}
	// New files: the next handshake has them.
	second := writeCerts(t, dir, base.Add(time.Minute))
	roots.AppendCertsFromPEM(second.CA)
	if got := served(t, addr, roots); !bytes.Equal(got, parseCert(t, second.Cert).Raw) {
		t.Error("not the second certificate")
	}
	// Files that do not load keep the second, with one warning.
	if err := os.WriteFile(filepath.Join(dir, CertFile), []byte("junk"), 0o644); err != nil {
		t.Fatal(err)
	}
	touch(t, dir, base.Add(2*time.Minute))
	for range 2 {
		if got := served(t, addr, roots); !bytes.Equal(got, parseCert(t, second.Cert).Raw) {
			t.Error("not the second certificate after junk")
		}
	}
	if n := strings.Count(logs.String(), "does not load"); n != 1 {
		t.Errorf("%d warnings:\n%s", n, logs.String())
	}
	// Files that are gone keep it too.
	if err := os.Remove(filepath.Join(dir, CertFile)); err != nil {
		t.Fatal(err)
	}
	if got := served(t, addr, roots); !bytes.Equal(got, parseCert(t, second.Cert).Raw) {
		t.Error("not the second certificate after removal")
	}

	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Serve: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return")
	}
	if _, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		t.Error("still listening")
	}
	if l := logs.String(); !strings.Contains(l, "msg=serving") || !strings.Contains(l, "serving certificate reloaded") {
		t.Errorf("log:\n%s", l)
	}
}

func TestServeWithoutCertificate(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	log, _ := testLogger()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	err = Serve(context.Background(), l, filepath.Join(dir, CertFile), filepath.Join(dir, KeyFile), log, nil)
	if err == nil || !strings.Contains(err.Error(), "load the serving certificate") {
		t.Errorf("got %v", err)
	}
	if err := os.WriteFile(filepath.Join(dir, CertFile), []byte("junk"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, KeyFile), []byte("junk"), 0o600); err != nil {
		t.Fatal(err)
	}
	err = Serve(context.Background(), l, filepath.Join(dir, CertFile), filepath.Join(dir, KeyFile), log, nil)
	if err == nil || !strings.Contains(err.Error(), "load the serving certificate: tls: failed to find any PEM data") {
		t.Errorf("got %v", err)
	}
}
