"""Tools that run models: capture routing, train and evaluate predictors, quantise experts."""
