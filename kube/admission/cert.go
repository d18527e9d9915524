package admission

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"
)

// Files Certs.Write creates, named as a kubernetes.io/tls Secret's keys.
const (
	CAFile   = "ca.crt"
	CertFile = "tls.crt"
	KeyFile  = "tls.key"
)

// DefaultValidity is how long generated certificates are valid.
const DefaultValidity = 365 * 24 * time.Hour

// clockSkew backdates certificates, for nodes whose clocks are behind.
const clockSkew = 5 * time.Minute

// CertOptions says what certificate GenerateCerts makes.
type CertOptions struct {
	// Service and Namespace name the webhook's Service: the certificate
	// is for <Service>.<Namespace>.svc (the name the API server checks)
	// and <Service>.<Namespace>.svc.cluster.local.
	Service, Namespace string
	// DNSNames and IPs are further names, e.g. 127.0.0.1 for a webhook
	// the API server calls by URL.
	DNSNames []string
	IPs      []net.IP
	// Validity is how long the certificates are valid (DefaultValidity
	// when 0).
	Validity time.Duration
	// Now is the time they are valid from (time.Now when nil).
	Now func() time.Time
}

// Certs are PEM blocks: a CA's certificate, and a serving certificate it
// signed with its key. The CA's key is not kept: new certificates come
// with a new CA (and a new caBundle).
type Certs struct {
	CA, Cert, Key []byte
}

// dnsNames returns the DNS names of the certificate for o: the Service's,
// then o.DNSNames.
func (o CertOptions) dnsNames() []string {
	var names []string
	if o.Service != "" {
		names = append(names, o.Service+"."+o.Namespace+".svc", o.Service+"."+o.Namespace+".svc.cluster.local")
	}
	return append(names, o.DNSNames...)
}

// GenerateCerts makes a CA and a serving certificate signed by it, both
// ECDSA P-256, for the names of o.
func GenerateCerts(o CertOptions) (*Certs, error) {
	if (o.Service == "") != (o.Namespace == "") {
		return nil, errors.New("a service needs a namespace, and a namespace a service")
	}
	names := o.dnsNames()
	if len(names) == 0 && len(o.IPs) == 0 {
		return nil, errors.New("no name for the certificate: give a service and namespace, a DNS name or an IP")
	}
	if o.Validity < 0 {
		return nil, fmt.Errorf("validity %v is negative", o.Validity)
	}
	if o.Validity == 0 {
		o.Validity = DefaultValidity
	}
	now := time.Now()
	if o.Now != nil {
		now = o.Now()
	}
	from, until := now.Add(-clockSkew), now.Add(o.Validity)
	subject := "mgpu-webhook"
	if len(names) > 0 {
		subject = names[0]
	}

	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	caTmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "mgpu-webhook CA " + now.UTC().Format(time.RFC3339)},
		NotBefore:             from,
		NotAfter:              until,
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("create the CA certificate: %w", err)
	}
	ca, err := x509.ParseCertificate(caDER)
	if err != nil {
		return nil, err
	}

	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: subject},
		DNSNames:              names,
		IPAddresses:           o.IPs,
		NotBefore:             from,
		NotAfter:              until,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("create the serving certificate: %w", err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return &Certs{
		CA:   pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}),
		Cert: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		Key:  pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER}),
	}, nil
}

// serial returns a random 128-bit serial number.
func serial() *big.Int {
	b := make([]byte, 16)
	_, _ = rand.Read(b) // never fails (crypto/rand)
	return new(big.Int).SetBytes(b)
}

// Write writes CAFile, CertFile and KeyFile (mode 0600, the others 0644)
// into dir, creating it (mode 0750). Files already there are an error
// (os.ErrExist) unless replace.
func (c *Certs) Write(dir string, replace bool) error {
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return err
	}
	files := []struct {
		name string
		data []byte
		mode os.FileMode
	}{{CAFile, c.CA, 0o644}, {CertFile, c.Cert, 0o644}, {KeyFile, c.Key, 0o600}}
	if !replace {
		for _, f := range files {
			p := filepath.Join(dir, f.name)
			if _, err := os.Lstat(p); err == nil {
				return fmt.Errorf("%s: %w", p, os.ErrExist)
			}
		}
	}
	for _, f := range files {
		p := filepath.Join(dir, f.name)
		// The key is written to a fresh file of mode 0600, never into
		// an existing file that others may read.
		if err := os.Remove(p); err != nil && !errors.Is(err, os.ErrNotExist) {
			return err
		}
		if err := os.WriteFile(p, f.data, f.mode); err != nil {
			return err
		}
	}
	return nil
}
