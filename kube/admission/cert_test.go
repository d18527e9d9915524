package admission

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/tls"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"
)

func parseCert(t *testing.T, b []byte) *x509.Certificate {
	t.Helper()
	blk, rest := pem.Decode(b)
	if blk == nil || blk.Type != "CERTIFICATE" || len(rest) > 0 {
		t.Fatalf("not one PEM certificate: %s", b)
	}
	c, err := x509.ParseCertificate(blk.Bytes)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

func TestGenerateCerts(t *testing.T) {
	t.Parallel()
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	certs, err := GenerateCerts(CertOptions{
		Service: "mgpu-webhook", Namespace: "kube-system",
		DNSNames: []string{"webhook.example"}, IPs: []net.IP{net.ParseIP("127.0.0.1")},
		Validity: 48 * time.Hour, Now: func() time.Time { return now },
	})
	if err != nil {
		t.Fatal(err)
	}
	ca, leaf := parseCert(t, certs.CA), parseCert(t, certs.Cert)
	if !ca.IsCA || leaf.IsCA {
		t.Errorf("CA %v, leaf CA %v", ca.IsCA, leaf.IsCA)
	}
	for _, c := range []*x509.Certificate{ca, leaf} {
		pub, ok := c.PublicKey.(*ecdsa.PublicKey)
		if !ok || pub.Curve != elliptic.P256() {
			t.Errorf("%s: key %T, want ECDSA P-256", c.Subject, c.PublicKey)
		}
		if !c.NotBefore.Equal(now.Add(-clockSkew)) || !c.NotAfter.Equal(now.Add(48*time.Hour)) {
			t.Errorf("%s: valid %v to %v", c.Subject, c.NotBefore, c.NotAfter)
		}
	}
	if _, err := tls.X509KeyPair(certs.Cert, certs.Key); err != nil {
		t.Errorf("the key is not the certificate's: %v", err)
	}
	roots := x509.NewCertPool()
	roots.AddCert(ca)
	at := now.Add(time.Hour)
	for _, name := range []string{"mgpu-webhook.kube-system.svc", "mgpu-webhook.kube-system.svc.cluster.local", "webhook.example", "127.0.0.1"} {
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: name, Roots: roots, CurrentTime: at, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}}); err != nil {
			t.Errorf("%s: %v", name, err)
		}
	}
	for _, name := range []string{"mgpu-webhook", "other.kube-system.svc", "127.0.0.2"} {
		if _, err := leaf.Verify(x509.VerifyOptions{DNSName: name, Roots: roots, CurrentTime: at}); err == nil {
			t.Errorf("%s: verified", name)
		}
	}
	if _, err := leaf.Verify(x509.VerifyOptions{DNSName: "webhook.example", Roots: roots, CurrentTime: now.Add(49 * time.Hour)}); err == nil {
		t.Error("verified after the validity")
	}
	// Another run is another CA.
	again, err := GenerateCerts(CertOptions{Service: "mgpu-webhook", Namespace: "kube-system"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := parseCert(t, again.Cert).Verify(x509.VerifyOptions{DNSName: "mgpu-webhook.kube-system.svc", Roots: roots}); err == nil {
		t.Error("a second certificate verified with the first CA")
	}
	if d := time.Until(parseCert(t, again.Cert).NotAfter); d < DefaultValidity-time.Hour || d > DefaultValidity {
		t.Errorf("default validity %v", d)
	}
}

func TestGenerateCertsErrors(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		o    CertOptions
		want string
	}{
		{name: "no name", o: CertOptions{}, want: "no name for the certificate: give a service and namespace, a DNS name or an IP"},
		{name: "service only", o: CertOptions{Service: "s"}, want: "a service needs a namespace, and a namespace a service"},
		{name: "negative", o: CertOptions{DNSNames: []string{"a"}, Validity: -time.Hour}, want: "validity -1h0m0s is negative"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			if _, err := GenerateCerts(tc.o); err == nil || err.Error() != tc.want {
				t.Errorf("got %v, want %q", err, tc.want)
			}
		})
	}
	// Names alone, without a Service, will do.
	if _, err := GenerateCerts(CertOptions{IPs: []net.IP{net.ParseIP("::1")}}); err != nil {
		t.Error(err)
	}
}

func TestCertsWrite(t *testing.T) {
	t.Parallel()
	dir := filepath.Join(t.TempDir(), "certs")
	c := &Certs{CA: []byte("ca"), Cert: []byte("cert"), Key: []byte("key")}
	if err := c.Write(dir, false); err != nil {
		t.Fatal(err)
	}
	for name, want := range map[string]os.FileMode{CAFile: 0o644, CertFile: 0o644, KeyFile: 0o600} {
		fi, err := os.Stat(filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode().Perm() != want {
			t.Errorf("%s: mode %v, want %v", name, fi.Mode().Perm(), want)
		}
	}
	c2 := &Certs{CA: []byte("ca2"), Cert: []byte("cert2"), Key: []byte("key2")}
	if err := c2.Write(dir, false); !errors.Is(err, os.ErrExist) {
		t.Errorf("over existing files: %v", err)
	}
	if b, _ := os.ReadFile(filepath.Join(dir, KeyFile)); string(b) != "key" {
		t.Errorf("a refused write changed the key: %q", b)
	}
	if err := os.Chmod(filepath.Join(dir, KeyFile), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := c2.Write(dir, true); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(filepath.Join(dir, KeyFile))
	if b, _ := os.ReadFile(filepath.Join(dir, KeyFile)); err != nil || string(b) != "key2" || fi.Mode().Perm() != 0o600 {
		t.Errorf("replaced key %q, mode %v, %v", b, fi.Mode(), err)
	}
}
