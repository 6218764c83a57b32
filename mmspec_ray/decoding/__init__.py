"""mmspec_ray.decoding"""
