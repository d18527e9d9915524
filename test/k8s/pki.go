package k8s

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"time"

	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
)

// pki is the cluster's certificate authority and the files it issued,
// all under one directory. Keys are ECDSA P-256: quick to make, and
// accepted everywhere a Kubernetes component takes a key (ES256 for
// service-account tokens).
type pki struct {
	dir    string
	cert   *x509.Certificate
	key    crypto.Signer
	CAPEM  []byte
	CAFile string
	CAKey  string // the CA's key file (the controller-manager's CSR signer)
}

func newPKI(dir string) (*pki, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          serial(),
		Subject:               pkix.Name{CommonName: "mgpu-k8s-ca"},
		NotBefore:             now.Add(-time.Hour),
		NotAfter:              now.Add(7 * 24 * time.Hour),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, fmt.Errorf("k8s: create CA: %w", err)
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	p := &pki{dir: dir, cert: cert, key: key,
		CAPEM:  pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		CAFile: filepath.Join(dir, "ca.crt"), CAKey: filepath.Join(dir, "ca.key")}
	if err := os.WriteFile(p.CAFile, p.CAPEM, 0o644); err != nil { //nolint:gosec // a certificate is public
		return nil, err
	}
	keyPEM, err := keyPEM(key)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(p.CAKey, keyPEM, 0o600); err != nil {
		return nil, err
	}
	return p, nil
}

func serial() *big.Int {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 120))
	if err != nil {
		panic(err) // crypto/rand does not fail on Linux
	}
	return n
}

func keyPEM(key *ecdsa.PrivateKey) ([]byte, error) {
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), nil
}

// certSpec says what a certificate is for.
type certSpec struct {
	cn     string
	orgs   []string
	server bool // serverAuth (with the SANs below) instead of clientAuth
	dns    []string
	ips    []net.IP
}

// issued is a certificate and key, in PEM and as files.
type issued struct {
	CertPEM, KeyPEM   []byte
	CertFile, KeyFile string
}

// issue signs a certificate for spec and writes <name>.crt and <name>.key.
func (p *pki) issue(name string, spec certSpec) (issued, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return issued{}, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber: serial(),
		Subject:      pkix.Name{CommonName: spec.cn, Organization: spec.orgs},
		NotBefore:    now.Add(-time.Hour),
		NotAfter:     now.Add(7 * 24 * time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature | x509.KeyUsageKeyEncipherment,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
		DNSNames:     spec.dns,
		IPAddresses:  spec.ips,
	}
	if spec.server {
		tmpl.ExtKeyUsage = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, p.cert, &key.PublicKey, p.key)
	if err != nil {
		return issued{}, fmt.Errorf("k8s: sign %q: %w", name, err)
	}
	out := issued{CertPEM: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		CertFile: filepath.Join(p.dir, name+".crt"), KeyFile: filepath.Join(p.dir, name+".key")}
	if out.KeyPEM, err = keyPEM(key); err != nil {
		return issued{}, err
	}
	if err := os.WriteFile(out.CertFile, out.CertPEM, 0o644); err != nil { //nolint:gosec // a certificate is public
		return issued{}, err
	}
	if err := os.WriteFile(out.KeyFile, out.KeyPEM, 0o600); err != nil {
		return issued{}, err
	}
	return out, nil
}

// serviceAccountKey writes the key pair that signs service-account tokens:
// sa.key (private, for the apiserver and the controller-manager) and
// sa.pub (public, for the apiserver to verify).
func (p *pki) serviceAccountKey() (priv, pub string, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	kp, err := keyPEM(key)
	if err != nil {
		return "", "", err
	}
	der, err := x509.MarshalPKIXPublicKey(&key.PublicKey)
	if err != nil {
		return "", "", err
	}
	priv, pub = filepath.Join(p.dir, "sa.key"), filepath.Join(p.dir, "sa.pub")
	if err := os.WriteFile(priv, kp, 0o600); err != nil {
		return "", "", err
	}
	if err := os.WriteFile(pub, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: der}), 0o644); err != nil { //nolint:gosec // a public key
		return "", "", err
	}
	return priv, pub, nil
}

// writeKubeconfig writes a self-contained kubeconfig (certificates and
// keys embedded) for server with either a client certificate or a bearer
// token.
func writeKubeconfig(path, server string, caPEM []byte, user string, cert *issued, token string) error {
	authInfo := &clientcmdapi.AuthInfo{Token: token}
	if cert != nil {
		authInfo = &clientcmdapi.AuthInfo{ClientCertificateData: cert.CertPEM, ClientKeyData: cert.KeyPEM}
	}
	cfg := clientcmdapi.Config{
		Clusters:       map[string]*clientcmdapi.Cluster{"mgpu": {Server: server, CertificateAuthorityData: caPEM}},
		AuthInfos:      map[string]*clientcmdapi.AuthInfo{user: authInfo},
		Contexts:       map[string]*clientcmdapi.Context{"mgpu": {Cluster: "mgpu", AuthInfo: user}},
		CurrentContext: "mgpu",
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	return clientcmd.WriteToFile(cfg, path)
}
