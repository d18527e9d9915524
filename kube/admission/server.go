package admission

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"sync"
	"time"
)

// Timeouts of the server. The API server gives a webhook at most 30 s
// (timeoutSeconds, 5 s in mgpu's manifest).
const (
	readHeaderTimeout = 5 * time.Second
	readTimeout       = 10 * time.Second
	writeTimeout      = 10 * time.Second
	idleTimeout       = 90 * time.Second
	shutdownTimeout   = 5 * time.Second
)

// Serve serves NewHandler (with tr, which may be nil) over TLS on l until ctx ends, then shuts down
// gracefully. The serving certificate and key are PEM files, read again
// when either changes (a Secret volume updated in place, a renewed
// certificate); a pair that does not load keeps the one before. A pair
// that does not load at the start is an error.
func Serve(ctx context.Context, l net.Listener, certFile, keyFile string, log *slog.Logger, tr *Translator) error {
	kp := &keyPair{certFile: certFile, keyFile: keyFile, log: log}
	if _, err := kp.certificate(nil); err != nil {
		return err
	}
	srv := &http.Server{
		Handler: NewHandler(log, tr),
		TLSConfig: &tls.Config{
			MinVersion:     tls.VersionTLS12,
			GetCertificate: kp.certificate,
		},
		ReadHeaderTimeout: readHeaderTimeout,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       idleTimeout,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelDebug),
	}
	served := make(chan error, 1)
	go func() { served <- srv.ServeTLS(l, "", "") }()
	log.Info("serving", "address", l.Addr().String(), "mutate", MutatePath, "health", HealthPath)
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	sctx, cancel := context.WithTimeout(context.Background(), shutdownTimeout)
	defer cancel()
	err := srv.Shutdown(sctx)
	if serr := <-served; !errors.Is(serr, http.ErrServerClosed) {
		return serr
	}
	return err
}

// keyPair is a certificate and key read from files, read again when the
// files change.
type keyPair struct {
	certFile, keyFile string
	log               *slog.Logger

	mu     sync.Mutex
	cert   *tls.Certificate
	loaded stamp // of the files cert was read from
	failed stamp // of files that did not load, not tried again
}

// stamp identifies a version of the two files.
type stamp struct {
	certMod, keyMod   int64 // ns since the epoch
	certSize, keySize int64
}

// certificate implements tls.Config.GetCertificate.
func (k *keyPair) certificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	s, err := k.stamp()
	if err != nil || (k.cert != nil && (s == k.loaded || s == k.failed)) {
		if k.cert == nil {
			return nil, err
		}
		return k.cert, nil // files gone or unchanged: keep what works
	}
	c, err := tls.LoadX509KeyPair(k.certFile, k.keyFile)
	if err != nil {
		err = fmt.Errorf("load the serving certificate: %w", err)
		if k.cert == nil {
			return nil, err
		}
		k.failed = s
		k.log.Warn("the new serving certificate does not load; keeping the old one", "err", err)
		return k.cert, nil
	}
	if k.cert != nil {
		k.log.Info("serving certificate reloaded", "cert", k.certFile, "key", k.keyFile)
	}
	k.cert, k.loaded = &c, s
	return k.cert, nil
}

func (k *keyPair) stamp() (stamp, error) {
	c, err := os.Stat(k.certFile)
	if err != nil {
		return stamp{}, fmt.Errorf("load the serving certificate: %w", err)
	}
	key, err := os.Stat(k.keyFile)
	if err != nil {
		return stamp{}, fmt.Errorf("load the serving key: %w", err)
	}
	return stamp{certMod: c.ModTime().UnixNano(), keyMod: key.ModTime().UnixNano(), certSize: c.Size(), keySize: key.Size()}, nil
}
