package admission

import (
	"bytes"
	"crypto/x509"
	"encoding/base64"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestCommand(t *testing.T) {
	t.Parallel()
	dir := t.TempDir()
	missing := filepath.Join(dir, "missing.crt")
	for _, tc := range []struct {
		name   string
		args   []string
		status int
		stdout []string // substrings
		stderr string   // substring of the one line
	}{
		{
			name: "help", args: []string{"--help"}, status: 0,
			stdout: []string{string(ResourceCore), string(ResourceMemory), PolicyKey, "guaranteed-burst-share", "POST /mutate", "GET /healthz", "mgpu-webhook cert", "-tls-cert-file", "-tls-key-file", "-listen", `":8443"`, "-log-format"},
		},
		{
			name: "cert help", args: []string{"cert", "--help"}, status: 0,
			stdout: []string{"ECDSA", "<service>.<namespace>.svc", "caBundle", "ca.crt", "-service", `"mgpu-webhook"`, "-namespace", `"kube-system"`, "-out", "-dns", "-ip", "-valid-for", "8760h0m0s", "-force"},
		},
		{name: "unknown flag", args: []string{"--bogus"}, status: 2, stderr: "mgpu-webhook: flag provided but not defined: -bogus (see --help)"},
		{name: "argument", args: []string{"serve"}, status: 2, stderr: `mgpu-webhook: unknown command "serve" (see --help)`},
		{name: "no certificate", args: []string{"--tls-key-file", "k"}, status: 2, stderr: "mgpu-webhook: --tls-cert-file and --tls-key-file are required (see --help)"},
		{name: "bad log level", args: []string{"--tls-cert-file", "c", "--tls-key-file", "k", "--log-level", "loud"}, status: 2, stderr: `bad --log-level "loud"`},
		{name: "bad log format", args: []string{"--tls-cert-file", "c", "--tls-key-file", "k", "--log-format", "xml"}, status: 2, stderr: `bad --log-format "xml"`},
		{name: "bad listen", args: []string{"--tls-cert-file", "c", "--tls-key-file", "k", "--listen", "127.0.0.1:99999"}, status: 1, stderr: "mgpu-webhook: listen tcp: address 99999: invalid port"},
		{
			name: "missing certificate", args: []string{"--tls-cert-file", missing, "--tls-key-file", missing, "--listen", "127.0.0.1:0"}, status: 1,
			stderr: "mgpu-webhook: load the serving certificate: stat " + missing + ": no such file or directory",
		},
		{name: "cert without out", args: []string{"cert"}, status: 2, stderr: "mgpu-webhook cert: --out is required (see --help)"},
		{name: "cert argument", args: []string{"cert", "--out", dir, "x"}, status: 2, stderr: `mgpu-webhook cert: takes no arguments, got "x"`},
		{name: "cert bad ip", args: []string{"cert", "--out", dir, "--ip", "localhost"}, status: 2, stderr: `mgpu-webhook cert: --ip "localhost" is not an IP address`},
		{name: "cert bad validity", args: []string{"cert", "--out", dir, "--valid-for", "0s"}, status: 2, stderr: "mgpu-webhook cert: --valid-for 0s is not a duration above 0"},
		{name: "cert bad duration", args: []string{"cert", "--out", dir, "--valid-for", "1y"}, status: 2, stderr: `mgpu-webhook cert: invalid value "1y" for flag -valid-for`},
		{name: "cert no namespace", args: []string{"cert", "--out", dir, "--namespace="}, status: 2, stderr: "mgpu-webhook cert: a service needs a namespace"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			var stdout, stderr bytes.Buffer
			if got := Command(tc.args, &stdout, &stderr); got != tc.status {
				t.Errorf("status %d, want %d (stderr %q)", got, tc.status, stderr.String())
			}
			for _, s := range tc.stdout {
				if !strings.Contains(stdout.String(), s) {
					t.Errorf("stdout lacks %q:\n%s", s, stdout.String())
				}
			}
			if tc.stderr == "" {
				if stderr.Len() > 0 {
					t.Errorf("stderr: %q", stderr.String())
				}
				return
			}
			if e := stderr.String(); !strings.Contains(e, tc.stderr) || strings.Count(e, "\n") != 1 {
				t.Errorf("stderr %q, want one line with %q", e, tc.stderr)
			}
		})
	}
}

func TestCommandCert(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "tls")
	args := []string{"cert", "--service", "hook", "--namespace", "mgpu", "--out", dir, "--ip", "127.0.0.1", "--dns", "a.example", "--dns", "b.example"}
	var stdout, stderr bytes.Buffer
	if got := Command(args, &stdout, &stderr); got != 0 {
		t.Fatalf("status %d: %s", got, stderr.String())
	}
	if e := stderr.String(); !strings.HasPrefix(e, "mgpu-webhook cert: wrote "+filepath.Join(dir, CAFile)+", tls.crt and tls.key, valid until ") || strings.Count(e, "\n") != 1 {
		t.Errorf("stderr %q", e)
	}
	bundle, err := base64.StdEncoding.DecodeString(strings.TrimSuffix(stdout.String(), "\n"))
	if err != nil {
		t.Fatalf("stdout %q: %v", stdout.String(), err)
	}
	ca, err := os.ReadFile(filepath.Join(dir, CAFile))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(bundle, ca) {
		t.Errorf("the caBundle is not %s", CAFile)
	}
	cert, err := os.ReadFile(filepath.Join(dir, CertFile))
	if err != nil {
		t.Fatal(err)
	}
	roots := x509.NewCertPool()
	roots.AppendCertsFromPEM(bundle)
	for _, name := range []string{"hook.mgpu.svc", "hook.mgpu.svc.cluster.local", "a.example", "b.example", "127.0.0.1"} {
		if _, err := parseCert(t, cert).Verify(x509.VerifyOptions{DNSName: name, Roots: roots}); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}

	// Again: refused, unless --force.
	stdout.Reset()
	stderr.Reset()
	if got := Command(args, &stdout, &stderr); got != 1 || !strings.Contains(stderr.String(), "file already exists (--force replaces the files, and the caBundle with them)") {
		t.Errorf("status %d, stderr %q", got, stderr.String())
	}
	stdout.Reset()
	stderr.Reset()
	if got := Command(append(args, "--force"), &stdout, &stderr); got != 0 {
		t.Errorf("status %d, stderr %q", got, stderr.String())
	}
	if again, _ := os.ReadFile(filepath.Join(dir, CAFile)); bytes.Equal(again, ca) {
		t.Error("--force kept the CA")
	}
}
